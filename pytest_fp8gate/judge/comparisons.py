"""Each candidate's comparisons with the baseline and its noise floors, computed once.

The verdicts, the markdown report and the plots read the same objects: the
log-prob comparison of a candidate (and of each noise pass) against the
baseline's main pass, per task the answer comparison and its floors, and the
decode phase's comparisons on generated positions (``decoded``, decode_comparisons.py).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..config.spec import GateConfig, TaskSpec
from ..core.answers import (
    AnswerComparison,
    AnswerRecord,
    Thinking,
    compare_answers,
    invalid_rate,
    length_drift,
    thinking_lengths,
)
from ..core.buckets import chunk_positions
from ..core.dumps import CUT_BY_LENGTH, read_finish_reasons, read_lm_eval_generations, read_thinking_chars
from ..core.logprobs import LogprobComparison, LogprobRun, compare_logprobs
from ..errors import ComparisonError, DumpFormatError, GateError
from ..run.record import ModelResult, PassResult
from .decode_comparisons import DecodeComparisons
from .records import Records


class Comparisons:
    """Memoised comparisons of the candidates with the baseline (a failed one is not kept)."""

    def __init__(self, config: GateConfig, records: Records) -> None:
        self.config = config
        self.records = records
        self._logprobs: dict[str, LogprobComparison] = {}
        self._logprob_floors: dict[str, LogprobComparison] | None = None
        self._references: dict[str, LogprobComparison] | None = None
        self._baseline_answers: dict[str, list[AnswerRecord]] = {}
        self._answers: dict[tuple[str, str], AnswerComparison] = {}
        self._answer_floors: dict[str, dict[str, AnswerComparison]] = {}
        self.decoded = DecodeComparisons(config, records)  # on generated positions
        self._candidate_noise: dict[str, dict[str, LogprobComparison]] = {}
        self._generations: dict[tuple[str, str], dict[Hashable, str]] = {}  # (pass key, task) -> doc -> text

    def baseline(self) -> ModelResult:
        """The baseline's own record (measured or restored on the first call)."""
        return self.records.record().result

    def logprobs(self, candidate: str) -> LogprobComparison:
        """The candidate's main pass against the baseline's, token by token."""
        if candidate not in self._logprobs:
            base_result, cand_result = self.baseline(), self.records.candidate(candidate)
            if base_result.vocab_size != cand_result.vocab_size:
                raise GateError(f"candidate {candidate}: vocabulary of {cand_result.vocab_size} tokens differs from "
                                f"baseline {self.config.baseline.name}'s {base_result.vocab_size}; "
                                "the probability rules compare the two token by token")
            base, cand = base_result.main.logprobs, cand_result.main.logprobs
            assert base is not None and cand is not None
            try:
                self._logprobs[candidate] = self._by_position(base, cand)
            except ComparisonError as err:
                raise GateError(f"candidate {candidate} vs baseline {self.config.baseline.name}: {err}") from None
        return self._logprobs[candidate]

    def logprob_floors(self) -> dict[str, LogprobComparison]:
        """Each noise pass that scored the corpus against the baseline's main pass."""
        if self._logprob_floors is None:
            self._logprob_floors = self._against_baseline(self.baseline().noise)
        return self._logprob_floors

    def references(self) -> dict[str, LogprobComparison]:
        """Each reference build's pass over the corpus against the baseline's main pass, by build name."""
        if self._references is None:
            self._references = self._against_baseline(self.baseline().references)
        return self._references

    def _against_baseline(self, passes: dict[str, PassResult]) -> dict[str, LogprobComparison]:
        base = self.baseline().main.logprobs
        assert base is not None
        return {label: self._by_position(base, run.logprobs) for label, run in passes.items()
                if run.logprobs is not None}

    def _by_position(self, base: LogprobRun, cand: LogprobRun) -> LogprobComparison:
        """``compare_logprobs`` with the figures per position bucket of the corpus chunks (issue 34)."""
        spec = self.config.probabilities
        assert spec is not None  # a probability pass exists only where [probabilities] is set
        return compare_logprobs(base, cand, self._positions(base.positions), spec.bucket_edges)

    def _positions(self, rows: int) -> np.ndarray:
        spec = self.config.probabilities
        assert spec is not None
        try:
            return chunk_positions(rows, spec.chunk_tokens)
        except ComparisonError as err:
            raise GateError(f"{self.config.path}: probabilities.chunk_tokens: the record's probability pass "
                            f"does not fit it: {err}") from None

    def baseline_answers(self, task: TaskSpec) -> list[AnswerRecord]:
        if task.name not in self._baseline_answers:
            self._baseline_answers[task.name] = self._read(self.baseline().main, task)
        return self._baseline_answers[task.name]

    def answers(self, candidate: str, task: TaskSpec) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
        """The candidate's answers on ``task`` against the baseline's, and each noise pass's."""
        if (candidate, task.name) not in self._answers:
            base = self.baseline_answers(task)
            cand = self._read(self.records.candidate(candidate).main, task)
            self._answers[candidate, task.name] = compare_answers(base, cand)
        if task.name not in self._answer_floors:
            base = self.baseline_answers(task)
            self._answer_floors[task.name] = {label: compare_answers(base, self._read(run, task))
                                              for label, run in self.baseline().noise.items()
                                              if task.name in run.samples}
        return self._answers[candidate, task.name], self._answer_floors[task.name]

    def _read(self, run: PassResult, task: TaskSpec) -> list[AnswerRecord]:
        try:
            return run.answers(task)
        except DumpFormatError as err:  # the samples exist; the configured filter or metric does not fit them
            index = self.config.tasks.index(task)
            raise GateError(f"{self.config.path}: tasks[{index}] (filter {task.filter!r}, metric {task.metric!r}): "
                            f"lm-eval's samples do not have it: {err.expected} (in {err.path})") from None

    def invalid_rates(self, candidate: str, task: TaskSpec) -> tuple[float, float, dict[str, float], int]:
        """The share of unparsable answers: the baseline's, the candidate's, each noise pass's, and the
        candidate's question count."""
        base = self.baseline_answers(task)
        cand = self._read(self.records.candidate(candidate).main, task)
        floors = {label: invalid_rate(self._read(run, task))
                  for label, run in self.baseline().noise.items() if task.name in run.samples}
        return invalid_rate(base), invalid_rate(cand), floors, len(cand)

    def truncations(self, candidate: str, task: TaskSpec) -> tuple[set[Hashable], set[Hashable],
                                                                    dict[str, set[Hashable]], int]:
        """The questions whose answer the token budget ended (finish_reason "length"): the baseline's,
        the candidate's, each noise pass's, and the number of questions."""
        base = self._cut("baseline", self.baseline().main, task)
        cand = self._cut(f"candidate {candidate}", self.records.candidate(candidate).main, task)
        floors = {label: self._cut(f"noise pass {label}", run, task)[0]
                  for label, run in self.baseline().noise.items() if task.name in run.samples}
        return base[0], cand[0], floors, cand[1]

    def _cut(self, who: str, run: PassResult, task: TaskSpec) -> tuple[set[Hashable], int]:
        path = run.samples[task.name]
        try:
            reasons = read_finish_reasons(path, task.filter)
        except DumpFormatError as err:
            raise GateError(f"{who} on {task.name}: cannot count answers cut by length: {err}") from None
        unknown = [doc for doc, reason in reasons.items() if reason is None or reason == [None]]
        if unknown:
            raise GateError(f"{who} on {task.name}: the engine reported no finish_reason for {len(unknown)} of "
                            f"{len(reasons)} answers (doc {unknown[0]!r}, {path}): cannot count answers cut by length")
        cut = {doc for doc, reason in reasons.items()
               if reason == CUT_BY_LENGTH or (isinstance(reason, list) and CUT_BY_LENGTH in reason)}
        return cut, len(reasons)

    def length_drifts(self, candidate: str, task: TaskSpec) -> tuple[float, dict[str, float]]:
        """The candidate's mean output-length drift against the baseline, and each noise pass's."""
        base = self._texts("baseline", self.baseline().main, task)
        cand = self._texts(f"candidate {candidate}", self.records.candidate(candidate).main, task)
        floors = {label: length_drift(base, self._texts(f"noise {label}", run, task))
                  for label, run in self.baseline().noise.items() if task.name in run.samples}
        return length_drift(base, cand), floors

    def thinking(self, candidate: str, task: TaskSpec) -> dict[str, Thinking]:
        """A task with think_end: the thinking lengths of the baseline, the candidate and each noise pass."""
        runs = {"baseline": self.baseline().main,
                f"candidate {candidate}": self.records.candidate(candidate).main}
        runs.update({f"noise pass {label}": run for label, run in self.baseline().noise.items()
                     if task.name in run.samples})
        found = {}
        for who, run in runs.items():
            try:
                found[who] = thinking_lengths(read_thinking_chars(run.samples[task.name], task.filter).values())
            except DumpFormatError as err:
                raise GateError(f"{who} on {task.name}: cannot report the thinking before think_end: {err}") from None
        return found

    def _texts(self, key: str, run: PassResult, task: TaskSpec) -> dict[Hashable, str]:
        if (key, task.name) not in self._generations:
            self._generations[key, task.name] = read_lm_eval_generations(run.samples[task.name], task.filter)
        return self._generations[key, task.name]

    def candidate_noise(self, candidate: str) -> dict[str, LogprobComparison]:
        """[noise] candidate_passes: the candidate's main pass against its own re-run, by pass label."""
        if candidate not in self._candidate_noise:
            result = self.records.candidate(candidate)
            main = result.main.logprobs
            self._candidate_noise[candidate] = {label: compare_logprobs(main, run.logprobs)
                                                for label, run in result.noise.items()
                                                if main is not None and run.logprobs is not None}
        return self._candidate_noise[candidate]
