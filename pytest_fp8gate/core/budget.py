"""The run's false-alarm budget (an addition): each candidate's rules that are tests share one per-run
alpha by Holm's step-down procedure, and every rule states the smallest regression it catches.

A rule that is a test has a one-sided p-value of "the candidate misses its limit" computed under a
build with no real change (the paired accuracy rule's McNemar p, the binomial flip rule's exact p, and
for a limit judged "within k SE" the normal tail of its shortfall in the null's SE). Holm tests the
smallest p at alpha/m, the next at alpha/(m-1), and so on, stopping at the first that passes: whatever
the rules' dependence, a candidate with no real change fails any of them with probability at most alpha.
Pure limits on a point estimate (speed, load, length drift) and the article's own margin rules
(accuracy within k SE, flips within ratio x the floor) are not tests and spend nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Hashable, Iterable, Mapping
from statistics import NormalDist
from typing import TypeVar

__all__ = ["ACCURACY_SHARE", "DETECTION_POWER", "RUN_ALPHA", "allowance_se", "budget_weights", "holm_levels",
           "level_allowance", "limit_p", "resolution_shift", "run_levels"]

DETECTION_POWER = 0.8  # the power at which every rule's resolution is quoted
RUN_ALPHA = 0.05  # the default per-run false-alarm budget (thresholds.toml run_alpha)
# The paired accuracy rule's share of the budget at Holm's first step (the rest split evenly among the other
# tests): the drop the gate exists to block, and the test with least room. A 2-point loss on 1,319 questions at
# 60 changed answers needs a level of 0.03 to fail with 80% power; the limits' planted faults miss them by
# hundreds of SEs, so a smaller share costs them little (docs/validity.md).
ACCURACY_SHARE = 0.6
_NORMAL = NormalDist()
K = TypeVar("K", bound=Hashable)


def limit_p(shortfall: float, se: float) -> float:
    """One-sided p-value of "the figure misses its limit" where it falls ``shortfall`` past it (negative:
    inside), the figure's SE that of a build with no real change: P(Z >= shortfall / se). With no SE the
    point estimate decides: 0 past the limit, 1 within it."""
    if se < 0:
        raise ValueError(f"se must be >= 0, got {se}")
    if se == 0 or not math.isfinite(shortfall):
        return 0.0 if shortfall > 0 else 1.0
    return _NORMAL.cdf(-shortfall / se)


def allowance_se(level: float) -> float:
    """The allowance in SEs of a one-sided normal test at ``level``: z with P(Z >= z) = level."""
    if not 0 < level < 1:
        raise ValueError(f"a test level must be in (0, 1), got {level}")
    return _NORMAL.inv_cdf(1 - level)


def resolution_shift(se: float, k: float, power: float = DETECTION_POWER) -> float:
    """How far past its limit a figure must truly sit for a rule allowing ``k`` SEs to fail it with
    ``power``: (k + z_power) x se, the figure's spread taken as the null's (a normal approximation)."""
    return (k + _NORMAL.inv_cdf(power)) * se


def holm_levels(p_values: Mapping[K, float], alpha: float, weights: Mapping[K, float] | None = None) -> dict[K, float]:
    """Each test's level under Holm's step-down at family-wise ``alpha``, weighted (Holm 1979): the test with
    the smallest p / weight is tested at alpha x its weight over the weights of the tests left, and on while
    each fails; from the first that passes on, each is tested at its level of that step, so it passes too. A
    test fails exactly when its p is at most its level. Equal weights (the default) give alpha / m, alpha /
    (m - 1), ... Ties keep the mapping's order; the result is in the order the tests are taken."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    weight = {key: 1.0 for key in p_values} if weights is None else {key: weights[key] for key in p_values}
    if min(weight.values(), default=1.0) <= 0:
        raise ValueError("every weight must be positive")
    left = sorted(p_values, key=lambda key: p_values[key] / weight[key])
    levels: dict[K, float] = {}
    while left:
        total = sum(weight[key] for key in left)
        key = left[0]
        levels[key] = alpha * weight[key] / total
        if p_values[key] > levels[key]:  # it passes, and so does every test left, at this step's levels
            levels.update({other: alpha * weight[other] / total for other in left[1:]})
            break
        left.pop(0)
    return levels


def budget_weights(keys: Iterable[K], favoured: Collection[K], share: float) -> dict[K, float]:
    """Weights that give the ``favoured`` tests ``share`` of the budget at the first step, split evenly, and
    the others the rest; where either group is empty, every test weighs the same."""
    keys = list(keys)
    rest = [key for key in keys if key not in favoured]
    chosen = [key for key in keys if key in favoured]
    if not rest or not chosen:
        return {key: 1.0 for key in keys}
    return {key: share / len(chosen) if key in favoured else (1 - share) / len(rest) for key in keys}


def run_levels(p_values: Mapping[K, float], alpha: float, paired: Collection[K]) -> dict[K, float]:
    """The gate's levels for one candidate's rule tests: weighted Holm at ``alpha``, the ``paired`` accuracy
    tests holding ACCURACY_SHARE of the budget at the first step (what the validity study mirrors)."""
    return holm_levels(p_values, alpha, budget_weights(p_values, paired, ACCURACY_SHARE))


def level_allowance(level: float | None, k: float) -> float:
    """A limit rule's allowance in SEs: ``k``, its own setting, where no run budget applies (``level``
    None), else the one-sided z of the level the budget gives it."""
    return k if level is None else allowance_se(level)
