"""The answers a task rule compares, once the baseline's are shown fit to compare against: above
min_baseline_accuracy, near expected_accuracy and measured under the expected protocol."""

from __future__ import annotations

import math
from typing import Any

from ..config.spec import TaskSpec
from ..core import protocol
from ..core.answers import AnswerComparison
from ..errors import GateError
from .judging import Judging
from .verdict import Case


def answer_comparison(judging: Judging, case: Case) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
    """The candidate's answers against the baseline's, and each noise pass's, on the case's task."""
    config, task = judging.config, judging.task(case)
    base = judging.comparisons.baseline_answers(task)
    accuracy = sum(answer.correct for answer in base) / len(base)
    floor = task.limits.min_baseline_accuracy
    if accuracy <= floor:
        raise GateError(
            f"baseline {config.baseline.name} scores {accuracy:.4f} on {task.name} ({len(base)} questions, "
            f"filter {task.filter!r}, metric {task.metric!r}), at or below {floor:g} "
            f"(tasks.limits.min_baseline_accuracy): the task cannot tell a broken build from a good one; "
            "check the task, filter, metric and few-shot setup"
        )
    _check_expected_accuracy(config.baseline.name, task, accuracy, len(base),
                             judging.comparisons.baseline().main.protocol(task))
    return judging.comparisons.answers(case.candidate, task)


def _check_expected_accuracy(baseline: str, task: TaskSpec, accuracy: float, questions: int,
                             measured_under: dict[str, Any] | None) -> None:
    """A baseline far from what it should score means the harness or the baseline is broken, and a
    paired comparison would pass vacuously on both. A figure measured under another protocol than
    ``measured_under`` (the baseline's, core/protocol.py) is refused: it is not this run's figure."""
    expected = task.limits.expected_accuracy
    if expected is None:
        return
    _check_protocol(baseline, task, measured_under)
    k = task.limits.expected_accuracy_se
    tolerance = k * math.sqrt(expected * (1 - expected) / questions)
    if abs(accuracy - expected) > tolerance:
        raise GateError(
            f"baseline {baseline} scores {accuracy:.4f} on {task.name} ({questions} questions, filter "
            f"{task.filter!r}, metric {task.metric!r}), but tasks.limits.expected_accuracy is {expected:g} "
            f"± {k:g} SE ({tolerance:.4f}): the harness or the baseline is broken (prompt format, few-shot, "
            "filter, metric, tokenizer or weights), so no comparison against it can be trusted")


def _check_protocol(baseline: str, task: TaskSpec, measured_under: dict[str, Any] | None) -> None:
    wanted = task.limits.expected_protocol
    if wanted is None:
        return
    setting = f"tasks {task.name!r} limits.expected_protocol"
    if measured_under is None:
        raise GateError(f"{setting}: baseline {baseline}'s protocol on {task.name} was not kept (a baseline cache "
                        "entry stored before protocols were); measure it again with --fp8gate-update-baseline")
    found = protocol.difference(wanted, measured_under)
    if found is not None:
        key, value, this_run = found
        raise GateError(f"{setting}.{key}: expected_accuracy was measured under {key} = {protocol.show(value)}, "
                        f"baseline {baseline} ran {task.name} under {key} = {protocol.show(this_run)}")
