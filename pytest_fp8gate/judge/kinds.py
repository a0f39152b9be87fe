"""The rule kinds' table: for each kind (core/rules.py's ``Kind``), the cases a thresholds file asks of its
rules, what a case needs measured and the verdict function that judges it (fidelity.py, tasks.py, speed.py;
each takes a ``Judging``, the case and its rule). Collection (face/cases.py) and the gate (gate.py) read this
one table instead of comparing kinds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config.spec import GateConfig
from ..core.rules import Kind, Rule
from ..run.record import Needs
from . import fidelity, speed, tasks
from .judging import VerdictFunction
from .verdict import Case

__all__ = ["KINDS", "KindWork"]


@dataclass(frozen=True)
class KindWork:
    """What the gate does for the rules of one kind."""

    cases: Callable[[Rule, GateConfig], list[Case]]  # the cases a thresholds file asks of a rule
    needs: Needs  # what each case needs measured of its candidate (a task rule's case: its task, added)
    verdict: VerdictFunction  # judges a case of the kind's rules
    skip: Callable[[GateConfig], str | None] = lambda config: None  # why its cases are collected but skipped


def _per_candidate(rule: Rule, config: GateConfig, wanted: bool) -> list[Case]:
    return [Case(rule.name, c.name) for c in config.candidates] if wanted else []


def _task_cases(rule: Rule, config: GateConfig) -> list[Case]:
    # A task rule without a default limit (the output sanity rules) runs only where it is set.
    wanted = [t for t in config.tasks if getattr(t.limits, rule.limit_key) is not None]
    return [Case(rule.name, c.name, t.name) for c in config.candidates for t in wanted]


def _limit_cases(rule: Rule, config: GateConfig, limits: Any, per_bucket: bool = False) -> list[Case]:
    """A probability or decode rule is collected where its limit is set (a bucket rule: and per_bucket)."""
    wanted = limits is not None and limits.sets(rule.limit_key)
    return _per_candidate(rule, config, wanted and (limits.per_bucket if per_bucket else True))


def _probability_limits(config: GateConfig) -> Any:
    return config.probabilities.limits if config.probabilities else None


def _speed_skip(config: GateConfig) -> str | None:
    if config.speed and config.device == "cpu" and not config.speed.bandwidth_gbps:
        return (f"{config.path.name}: no memory-bandwidth figure for the CPU engine "
                "(set speed.bandwidth_gbps to judge decode speed against a ceiling)")
    return None


KINDS: dict[Kind, KindWork] = {
    Kind.PROBABILITY: KindWork(
        lambda rule, config: _limit_cases(rule, config, _probability_limits(config)), Needs(probabilities=True),
        fidelity.probability),
    Kind.BUCKET: KindWork(
        lambda rule, config: _limit_cases(rule, config, _probability_limits(config), per_bucket=True),
        Needs(probabilities=True), fidelity.bucket),
    Kind.TASK: KindWork(_task_cases, Needs(), tasks.verdict),
    Kind.SPEED: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.speed)), Needs(speed=True),
                         speed.speed, skip=_speed_skip),
    Kind.DECODE: KindWork(
        lambda rule, config: _limit_cases(rule, config, config.decode.limits if config.decode else None),
        Needs(decode=True), fidelity.decode),
    Kind.LOAD: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.load)), Needs(load=True),
                        speed.load),
    Kind.SPECULATIVE: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.speculative)),
                               Needs(speculative=True), speed.acceptance),
}
