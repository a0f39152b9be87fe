"""The decode phase's comparisons on generated positions, computed once: each candidate's prefill of the
baseline's continuations against the baseline's decode-time log-probs, beside the floors, and each
model's decode against its own prefill of the same ids."""

from __future__ import annotations

from ..config.spec import GateConfig
from ..core.decode_phase import DecodeComparison, DecodeRun, compare_decode
from ..core.logprobs import LogprobRun
from ..errors import ComparisonError, GateError
from ..run.record import DecodeResult
from .records import Records

# The floor of a decode-phase figure: an identical candidate would still show the baseline's own gap.
BASELINE_GAP = "baseline decode vs prefill"


class DecodeComparisons:
    """Memoised comparisons on generated positions (a failed one is not kept)."""

    def __init__(self, config: GateConfig, records: Records) -> None:
        self.config = config
        self.records = records
        self._decode: dict[str, DecodeComparison] = {}
        self._decode_floors: dict[str, DecodeComparison] | None = None
        self._decode_gaps: dict[str, DecodeComparison] = {}

    def decode(self, candidate: str) -> tuple[DecodeComparison, dict[str, DecodeComparison]]:
        """The candidate's prefill of the baseline's continuations against the baseline's decode-time
        log-probs, and the same comparison for each floor (the baseline's own prefill, its noise passes)."""
        if candidate not in self._decode:
            decode = self.records.candidate(candidate).decode
            assert decode is not None and decode.on_baseline is not None  # measured where a decode rule runs
            self._decode[candidate] = self._compare(f"candidate {candidate} on the baseline's continuations",
                                                    self._baseline_decode().own, decode.on_baseline)
        if self._decode_floors is None:
            own = self._baseline_decode().own
            floors = {BASELINE_GAP: self.baseline_gap()}
            floors.update({label: self._compare(f"noise pass {label}", own, run)
                           for label, run in self.records.record().decode_floor.items()})
            self._decode_floors = floors
        return self._decode[candidate], self._decode_floors

    def decode_gap(self, candidate: str) -> DecodeComparison:
        """The candidate's decode-time log-probs against its own prefill of the same ids."""
        if candidate not in self._decode_gaps:
            result = self.records.candidate(candidate).decode
            assert result is not None  # measured where a decode rule runs
            self._decode_gaps[candidate] = self._compare(f"candidate {candidate} decode vs prefill", result.own,
                                                         result.own_prefill)
        return self._decode_gaps[candidate]

    def baseline_gap(self) -> DecodeComparison:
        """The baseline's decode against its own prefill: the floor of every decode-phase figure."""
        name = self.config.baseline.name
        if name not in self._decode_gaps:
            result = self._baseline_decode()
            self._decode_gaps[name] = self._compare("baseline decode vs prefill", result.own, result.own_prefill)
        return self._decode_gaps[name]

    def _baseline_decode(self) -> DecodeResult:
        decode = self.records.record().result.decode
        assert decode is not None  # measured where a decode rule runs
        return decode

    def _compare(self, what: str, base: DecodeRun, cand: LogprobRun) -> DecodeComparison:
        spec = self.config.probabilities
        try:
            return compare_decode(base, cand, spec.bucket_edges if spec is not None else None)
        except ComparisonError as err:
            raise GateError(f"{what}: {err}") from None
