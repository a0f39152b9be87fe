"""Which rule cases a thresholds file asks for, with their marks."""

from __future__ import annotations

from typing import Any

import pytest

from .config import GateConfig
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
    if rule in ("accuracy", "flips"):
        cases = [Case(rule, c.name, t.name) for c in config.candidates for t in config.tasks]
    elif rule == "speed":
        cases = [Case(rule, c.name) for c in config.candidates] if config.speed else []
        if config.speed and config.device == "cpu" and not config.speed.bandwidth_gbps:
            marks.append(pytest.mark.skip(
                reason=f"{config.path.name}: no memory-bandwidth figure for the CPU engine "
                "(set speed.bandwidth_gbps to judge decode speed against a ceiling)"))
    else:
        limits = config.probabilities.limits if config.probabilities else None
        wanted = limits is not None and getattr(limits, PROBABILITY_LIMITS[rule]) is not None
        cases = [Case(rule, c.name) for c in config.candidates] if wanted else []
    return [pytest.param(case, id=case.id, marks=marks) for case in cases]


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
