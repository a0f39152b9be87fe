"""Which rule cases a thresholds file asks for, with their marks."""

from __future__ import annotations

from typing import Any

import pytest

from .capabilities import cpu_engine_refusal
from .spec import GateConfig
from .gate import Case
from .measure import Needs

# test function -> rule name; probability rules exist only where a limit is configured
TEST_RULES = {
    "test_accuracy_within_se": "accuracy",
    "test_flips_within_noise_floor": "flips",
    "test_same_top_near_baseline": "same_top",
    "test_rms_dp_within_limit": "rms_dp",
    "test_ppl_ratio_within_limit": "ppl_ratio",
    "test_kl_within_limit": "mean_kl",
    "test_decode_speed_near_ceiling": "speed",
}
PROBABILITY_LIMITS = {"same_top": "min_same_top", "rms_dp": "max_rms_dp",
                      "ppl_ratio": "max_ppl_ratio", "mean_kl": "max_mean_kl"}


def cases_for(test_name: str, config: GateConfig) -> list[Any]:
    rule = TEST_RULES[test_name]
    marks: list[Any] = [pytest.mark.fp8gate]
    if config.device == "cuda":
        marks.append(pytest.mark.gpu)
    if rule == "speed" and config.speed and config.device == "cpu" and not config.speed.bandwidth_gbps:
        marks.append(pytest.mark.skip(
            reason=f"{config.path.name}: no memory-bandwidth figure for the CPU engine "
            "(set speed.bandwidth_gbps to judge decode speed against a ceiling)"))
    return [pytest.param(case, id=case.id, marks=marks + _engine_marks(config, case))
            for case in _cases(rule, config)]


def _engine_marks(config: GateConfig, case: Case) -> list[Any]:
    """A skip for a candidate the configured engine is known to refuse, with the engine's reason."""
    if config.device != "cpu":
        return []
    spec = next(c for c in config.candidates if c.name == case.candidate)
    refusal = cpu_engine_refusal(spec.model, spec.quantization)
    return [pytest.mark.skip(reason=f"{config.path.name}: candidate {spec.name}: {refusal}")] if refusal else []


def _cases(rule: str, config: GateConfig) -> list[Case]:
    if rule in ("accuracy", "flips"):
        return [Case(rule, c.name, t.name) for c in config.candidates for t in config.tasks]
    if rule == "speed":
        return [Case(rule, c.name) for c in config.candidates] if config.speed else []
    limits = config.probabilities.limits if config.probabilities else None
    wanted = limits is not None and getattr(limits, PROBABILITY_LIMITS[rule]) is not None
    return [Case(rule, c.name) for c in config.candidates] if wanted else []


def needs_of(cases: list[Case]) -> dict[str, Needs]:
    """Per candidate, what its selected cases need measured."""
    needs: dict[str, Needs] = {}
    for case in cases:
        need = Needs(
            probabilities=case.rule in PROBABILITY_LIMITS,
            tasks=frozenset([case.task]) if case.task else frozenset(),
            speed=case.rule == "speed",
        )
        needs[case.candidate] = needs.get(case.candidate, Needs()) | need
    return needs
