"""A rule's case and its verdict: what the pytest face collects and the reports read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..config.spec import GateConfig
from ..core.rules import RuleOutcome
from ..options import display_path

BUDGET = "budget"  # a verdict's details key of its share of the run's false-alarm budget (an addition)


@dataclass(frozen=True)
class Case:
    """One parametrized rule test: a rule, a candidate and, for tasks, the task."""

    rule: str
    candidate: str
    task: str | None = None

    @property
    def id(self) -> str:
        return self.candidate if self.task is None else f"{self.candidate}-{self.task}"


@dataclass(frozen=True)
class Verdict:
    case: Case
    outcome: RuleOutcome
    details: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    limit: str | None = None  # where the limit is set: "thresholds.toml probabilities.limits.max_mean_kl = 0.01"
    recompute: str | None = None  # the fp8gate command that recomputes the measured number from the artifacts
    served: str | None = None  # how the engine served the candidate, when not as named (stack.served_otherwise)

    @property
    def passed(self) -> bool:
        return self.outcome.passed

    def explain(self) -> str:
        state = "passed" if self.passed else "FAILED"
        subject = f" on {self.case.task}" if self.case.task else ""
        served = f" ({self.served})" if self.served else ""
        lines = [f"{self.outcome.rule} {state} for candidate {self.case.candidate}{subject}{served}"]
        width = max(len(label) for label, _ in self.outcome.rows)
        lines += [f"  {label:<{width}}  {number(value)}" for label, value in self.outcome.rows]
        lines += [f"  note: {note}" for note in self.notes]
        if self.examples:
            lines.append(f"  first {len(self.examples)} flipped questions:")
            lines += self.examples
        if self.limit:
            lines.append(f"  limit: {self.limit}")
        if self.recompute:
            lines.append(f"  recompute: {self.recompute}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.case.candidate, "task": self.case.task, **self.outcome.as_dict(),
                "notes": list(self.notes), "details": self.details, "setting": self.limit,
                "recompute": self.recompute, "served": self.served}


def number(value: float) -> str:
    """A rule's number as the explanations print it."""
    return f"{value:.6g}"


def limit_setting(config: GateConfig, key: str, value: float) -> str:
    """Where a verdict's limit is set: "thresholds.toml probabilities.limits.max_mean_kl = 0.01"."""
    return f"{display_path(config.path)} {key} = {value:g}"
