"""Which rule cases a thresholds file asks for, with their marks."""

from __future__ import annotations

from typing import Any

import pytest

from ..config.spec import GateConfig
from ..core import rules
from ..engines.backend import engine_class_for
from ..engines.base import Engine
from ..judge.verdict import Case
from ..run.record import Needs


def cases_for(test_name: str, config: GateConfig, engine_class: type[Engine]) -> list[Any]:
    """The rule test's cases with their marks; ``engine_class``: what runs a model not served."""
    rule = rules.BY_TEST[test_name]
    marks: list[Any] = [pytest.mark.fp8gate]
    if config.device == "cuda":
        marks.append(pytest.mark.gpu)
    if rule.kind == "speed" and config.speed and config.device == "cpu" and not config.speed.bandwidth_gbps:
        marks.append(pytest.mark.skip(
            reason=f"{config.path.name}: no memory-bandwidth figure for the CPU engine "
            "(set speed.bandwidth_gbps to judge decode speed against a ceiling)"))
    return [pytest.param(case, id=case.id, marks=marks + _engine_marks(config, case, engine_class))
            for case in _cases(rule, config)]


def _engine_marks(config: GateConfig, case: Case, engine_class: type[Engine]) -> list[Any]:
    """A skip for a candidate its engine is known to refuse, with the engine's reason."""
    spec = next(c for c in config.candidates if c.name == case.candidate)
    refusal = engine_class_for(spec, engine_class).refusal(spec, config.device)
    return [pytest.mark.skip(reason=f"{config.path.name}: candidate {spec.name}: {refusal}")] if refusal else []


def _cases(rule: rules.Rule, config: GateConfig) -> list[Case]:
    if rule.kind == "task":
        # A task rule without a default limit (the output sanity rules) runs only where it is set.
        tasks = [t for t in config.tasks if getattr(t.limits, rule.limit_key) is not None]
        return [Case(rule.name, c.name, t.name) for c in config.candidates for t in tasks]
    if rule.kind == "speed":
        return [Case(rule.name, c.name) for c in config.candidates] if config.speed else []
    if rule.kind == "load":
        return [Case(rule.name, c.name) for c in config.candidates] if config.load else []
    if rule.kind == "speculative":
        return [Case(rule.name, c.name) for c in config.candidates] if config.speculative else []
    if rule.kind == "decode":
        limits: Any = config.decode.limits if config.decode else None
    else:
        limits = config.probabilities.limits if config.probabilities else None
    wanted = limits is not None and limits.sets(rule.limit_key)
    if rule.kind == "bucket":
        wanted = wanted and limits.per_bucket
    return [Case(rule.name, c.name) for c in config.candidates] if wanted else []


def needs_of(cases: list[Case]) -> dict[str, Needs]:
    """Per candidate, what its selected cases need measured."""
    needs: dict[str, Needs] = {}
    for case in cases:
        kind = rules.BY_NAME[case.rule].kind
        need = Needs(
            probabilities=kind in ("probability", "bucket"),
            tasks=frozenset([case.task]) if case.task else frozenset(),
            speed=kind == "speed",
            decode=kind == "decode",
            load=kind == "load",
            speculative=kind == "speculative",
        )
        needs[case.candidate] = needs.get(case.candidate, Needs()) | need
    return needs
