"""What every verdict function is given besides its case and rule: the comparisons (and the thresholds
and records behind them) and the case's share of the run's false-alarm budget. The kind table
(kinds.py) calls each family's verdict function (fidelity.py, tasks.py, speed.py) with one."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.spec import GateConfig, TaskSpec
from ..core.rules import Rule
from .comparisons import Comparisons
from .records import Records
from .verdict import Case, Verdict, limit_setting


@dataclass(frozen=True)
class Judging:
    """The evidence a verdict reads, and the level it is judged at."""

    comparisons: Comparisons
    level: float | None = None  # the case's share of run_alpha; None: the rule's own settings decide

    @property
    def config(self) -> GateConfig:
        return self.comparisons.config

    @property
    def records(self) -> Records:
        return self.comparisons.records

    def limit(self, key: str, value: Any) -> str:
        """Where the verdict's limit is set: the thresholds file, the key and its value."""
        return limit_setting(self.config, key, value)

    def task(self, case: Case) -> TaskSpec:
        """A task rule's case's task."""
        return next(t for t in self.config.tasks if t.name == case.task)

    def task_limit(self, task: TaskSpec, key: str, value: float) -> str:
        return self.limit(f"tasks[{self.config.tasks.index(task)}].limits.{key}", value)


# Every rule's verdict, whatever its family: what the kind table names for each kind.
VerdictFunction = Callable[[Judging, Case, Rule], Verdict]
