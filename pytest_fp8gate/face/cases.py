"""Which rule cases a thresholds file asks for, with their marks."""

from __future__ import annotations

from typing import Any

import pytest

from ..config.spec import GateConfig
from ..core import rules
from ..engines.backend import EngineChoice, engine_class_for
from ..engines.base import Engine
from ..judge.kinds import KINDS
from ..judge.verdict import Case
from ..run.record import Needs


def cases_for(test_name: str, config: GateConfig, engine_class: type[Engine] | EngineChoice | None) -> list[Any]:
    """The rule test's cases with their marks; ``engine_class``: what runs the models, as measuring is given it
    (``engines.backend.engine_class_for``)."""
    rule = rules.BY_TEST[test_name]
    marks: list[Any] = [pytest.mark.fp8gate]
    if config.device == "cuda":
        marks.append(pytest.mark.gpu)
    kind = KINDS[rule.kind]
    reason = kind.skip(config)
    if reason:
        marks.append(pytest.mark.skip(reason=reason))
    return [pytest.param(case, id=case.id, marks=marks + _engine_marks(config, case, engine_class))
            for case in kind.cases(rule, config)]


def _engine_marks(config: GateConfig, case: Case, engine_class: type[Engine] | EngineChoice | None) -> list[Any]:
    """A skip for a candidate its engine is known to refuse, with the engine's reason."""
    spec = next(c for c in config.candidates if c.name == case.candidate)
    refusal = engine_class_for(spec, engine_class).refusal(spec, config.device)
    return [pytest.mark.skip(reason=f"{config.path.name}: candidate {spec.name}: {refusal}")] if refusal else []


def needs_of(cases: list[Case]) -> dict[str, Needs]:
    """Per candidate, what its selected cases need measured."""
    needs: dict[str, Needs] = {}
    for case in cases:
        need = KINDS[rules.BY_NAME[case.rule].kind].needs | Needs(tasks=frozenset([case.task] if case.task else []))
        needs[case.candidate] = needs.get(case.candidate, Needs()) | need
    return needs
