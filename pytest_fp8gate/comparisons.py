"""Each candidate's comparisons with the baseline and its noise floors, computed once.

The verdicts, the markdown report and the plots read the same objects: the
log-prob comparison of a candidate (and of each noise pass) against the
baseline's main pass, and per task the answer comparison and its floors.
"""

from __future__ import annotations

from typing import Protocol

from .answers import AnswerComparison, AnswerRecord, compare_answers
from .errors import ComparisonError, DumpFormatError, GateError
from .logprobs import LogprobComparison, compare_logprobs
from .record import BaselineRecord, ModelResult, PassResult
from .spec import GateConfig, TaskSpec


class Measured(Protocol):
    """What the comparisons read: ``measure.Measurements``, or a record an earlier run left."""

    id_scoring_refusal: str | None  # why the engine could not score the baseline's top-k ids, if it could not

    def baseline(self) -> ModelResult: ...

    def candidate(self, name: str) -> ModelResult: ...

    def noise(self) -> dict[str, PassResult]: ...


class Recorded:
    """A baseline record and the candidates measured with it (what the report is handed)."""

    def __init__(self, baseline: BaselineRecord, candidates: dict[str, ModelResult]) -> None:
        self.record, self.candidates = baseline, candidates
        self.id_scoring_refusal = baseline.id_scoring_refusal

    def baseline(self) -> ModelResult:
        return self.record.result

    def candidate(self, name: str) -> ModelResult:
        return self.candidates[name]

    def noise(self) -> dict[str, PassResult]:
        return self.record.noise


class Comparisons:
    """Memoised comparisons of the candidates with the baseline (a failed one is not kept)."""

    def __init__(self, config: GateConfig, measured: Measured) -> None:
        self.config = config
        self.measured = measured
        self._logprobs: dict[str, LogprobComparison] = {}
        self._logprob_floors: dict[str, LogprobComparison] | None = None
        self._baseline_answers: dict[str, list[AnswerRecord]] = {}
        self._answers: dict[tuple[str, str], AnswerComparison] = {}
        self._answer_floors: dict[str, dict[str, AnswerComparison]] = {}

    def logprobs(self, candidate: str) -> LogprobComparison:
        """The candidate's main pass against the baseline's, token by token."""
        if candidate not in self._logprobs:
            base_result, cand_result = self.measured.baseline(), self.measured.candidate(candidate)
            if base_result.vocab_size != cand_result.vocab_size:
                raise GateError(f"candidate {candidate}: vocabulary of {cand_result.vocab_size} tokens differs from "
                                f"baseline {self.config.baseline.name}'s {base_result.vocab_size}; "
                                "the probability rules compare the two token by token")
            base, cand = base_result.main.logprobs, cand_result.main.logprobs
            assert base is not None and cand is not None
            try:
                self._logprobs[candidate] = compare_logprobs(base, cand)
            except ComparisonError as err:
                raise GateError(f"candidate {candidate} vs baseline {self.config.baseline.name}: {err}") from None
        return self._logprobs[candidate]

    def logprob_floors(self) -> dict[str, LogprobComparison]:
        """Each noise pass that scored the corpus against the baseline's main pass."""
        if self._logprob_floors is None:
            base = self.measured.baseline().main.logprobs
            assert base is not None
            self._logprob_floors = {label: compare_logprobs(base, run.logprobs)
                                    for label, run in self.measured.noise().items() if run.logprobs is not None}
        return self._logprob_floors

    def baseline_answers(self, task: TaskSpec) -> list[AnswerRecord]:
        if task.name not in self._baseline_answers:
            self._baseline_answers[task.name] = self._read(self.measured.baseline().main, task)
        return self._baseline_answers[task.name]

    def answers(self, candidate: str, task: TaskSpec) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
        """The candidate's answers on ``task`` against the baseline's, and each noise pass's."""
        if (candidate, task.name) not in self._answers:
            base = self.baseline_answers(task)
            cand = self._read(self.measured.candidate(candidate).main, task)
            self._answers[candidate, task.name] = compare_answers(base, cand)
        if task.name not in self._answer_floors:
            base = self.baseline_answers(task)
            self._answer_floors[task.name] = {label: compare_answers(base, self._read(run, task))
                                              for label, run in self.measured.noise().items()
                                              if task.name in run.samples}
        return self._answers[candidate, task.name], self._answer_floors[task.name]

    def _read(self, run: PassResult, task: TaskSpec) -> list[AnswerRecord]:
        try:
            return run.answers(task)
        except DumpFormatError as err:  # the samples exist; the configured filter or metric does not fit them
            index = self.config.tasks.index(task)
            raise GateError(f"{self.config.path}: tasks[{index}] (filter {task.filter!r}, metric {task.metric!r}): "
                            f"lm-eval's samples do not have it: {err.expected} (in {err.path})") from None
