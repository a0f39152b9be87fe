"""The one-sided Clopper-Pearson upper bound of a rate (an addition to the article's statistics)."""

from __future__ import annotations

import math

__all__ = ["upper_bound"]


def upper_bound(failures: int, trials: int, confidence: float = 0.95) -> float:
    """One-sided Clopper-Pearson upper bound of a rate seen failures times in trials."""
    def cdf(p: float) -> float:
        return sum(math.comb(trials, i) * p**i * (1 - p) ** (trials - i) for i in range(failures + 1))
    low, high = failures / trials, 1.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) > 1 - confidence else (low, middle)
    return high
