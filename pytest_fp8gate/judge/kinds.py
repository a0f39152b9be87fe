"""The rule kinds' table: for each kind (core/rules.py's ``Kind``), the cases a thresholds file asks of its
rules, what a case needs measured and how the gate judges it. Collection (face/cases.py) and the gate
(gate.py) read this one table instead of comparing kinds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config.spec import GateConfig
from ..core.rules import Kind, Rule
from ..run.record import Needs
from . import generation_verdicts
from .comparisons import Comparisons
from .verdict import Case, Verdict

__all__ = ["KINDS", "Judging", "KindWork"]


class Judging(Protocol):
    """The gate's verdict methods the table calls (gate.py's ``Gate``)."""

    comparisons: Comparisons

    def probability(self, case: Case, rule: Rule, level: float | None = None) -> Verdict: ...

    def bucket(self, case: Case, rule: Rule, level: float | None = None) -> Verdict: ...

    def by_rule(self, case: Case, rule: Rule, level: float | None) -> Verdict: ...


@dataclass(frozen=True)
class KindWork:
    """What the gate does for the rules of one kind."""

    cases: Callable[[Rule, GateConfig], list[Case]]  # the cases a thresholds file asks of a rule
    needs: Needs  # what each case needs measured of its candidate (a task rule's case: its task, added)
    judge: Callable[[Judging, Case, Rule, float | None], Verdict]  # level: the case's share of run_alpha
    skip: Callable[[GateConfig], str | None] = lambda config: None  # why its cases are collected but skipped


def _per_candidate(rule: Rule, config: GateConfig, wanted: bool) -> list[Case]:
    return [Case(rule.name, c.name) for c in config.candidates] if wanted else []


def _task_cases(rule: Rule, config: GateConfig) -> list[Case]:
    # A task rule without a default limit (the output sanity rules) runs only where it is set.
    tasks = [t for t in config.tasks if getattr(t.limits, rule.limit_key) is not None]
    return [Case(rule.name, c.name, t.name) for c in config.candidates for t in tasks]


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


def _judge_decode(gate: Judging, case: Case, rule: Rule, level: float | None) -> Verdict:
    # The probability rules on generated positions share one judge, driven by their row; the gap has its own.
    if rule.bound is not None:
        return generation_verdicts.decode_phase(gate.comparisons, case, rule, level)
    return gate.by_rule(case, rule, level)


def _by_rule(gate: Judging, case: Case, rule: Rule, level: float | None) -> Verdict:
    return gate.by_rule(case, rule, level)


KINDS: dict[Kind, KindWork] = {
    Kind.PROBABILITY: KindWork(
        lambda rule, config: _limit_cases(rule, config, _probability_limits(config)), Needs(probabilities=True),
        lambda gate, case, rule, level: gate.probability(case, rule, level)),
    Kind.BUCKET: KindWork(
        lambda rule, config: _limit_cases(rule, config, _probability_limits(config), per_bucket=True),
        Needs(probabilities=True), lambda gate, case, rule, level: gate.bucket(case, rule, level)),
    Kind.TASK: KindWork(_task_cases, Needs(), _by_rule),
    Kind.SPEED: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.speed)), Needs(speed=True),
                         _by_rule, skip=_speed_skip),
    Kind.DECODE: KindWork(
        lambda rule, config: _limit_cases(rule, config, config.decode.limits if config.decode else None),
        Needs(decode=True), _judge_decode),
    Kind.LOAD: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.load)), Needs(load=True),
                        _by_rule),
    Kind.SPECULATIVE: KindWork(lambda rule, config: _per_candidate(rule, config, bool(config.speculative)),
                               Needs(speculative=True), _by_rule),
}
