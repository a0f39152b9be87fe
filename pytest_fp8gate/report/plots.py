"""PNG plots of one candidate against the noise floor (matplotlib, the optional ``report`` extra).

Each plot puts the candidate next to the baseline's noise passes on the same
axes, so a reader sees how far outside (or inside) run-to-run noise it lies.
matplotlib's object API is used without pyplot: no global figure state, no GUI
backend, safe inside a pytest session.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from ..atomic import atomic_open
from ..core.answers import AnswerComparison
from ..core.logprobs import LogprobComparison, LogprobRun

T = TypeVar("T")

INSTALL_HINT = "pip install 'pytest-fp8gate[report]'"
CANDIDATE_COLOR = "#c0392b"
FLOOR_COLORS = ("#2471a3", "#7d3c98", "#1e8449")
_BINS = 61  # odd, so that Δp = 0 falls in the middle of a bin


def available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _figure(width: float = 7.5, height: float = 4.2) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _finish(axes: Any, title: str) -> None:
    axes.set_title(title)
    # Below the axes: a legend inside would hide the tails, where the candidate differs.
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)


def _save(figure: Any, path: Path) -> None:
    with atomic_open(path, "wb") as handle:
        figure.savefig(handle, format="png")


def _series(cand: T, floors: dict[str, T]) -> list[tuple[str, T, str]]:
    """(legend label, run or comparison, colour): the candidate first, then each noise pass."""
    return [("candidate", cand, CANDIDATE_COLOR)] + [
        (f"noise floor: {label}", run, FLOOR_COLORS[i % len(FLOOR_COLORS)])
        for i, (label, run) in enumerate(floors.items())]


def delta_p_histogram(base: LogprobRun, cand: LogprobRun, floors: dict[str, LogprobRun], title: str,
                      path: Path) -> None:
    """Δp = p_cand - p_base of the real next token, per position: candidate against each noise pass."""
    series = [(label, np.exp(run.real_logprob) - np.exp(base.real_logprob), color)
              for label, run, color in _series(cand, floors)]
    reach = max(float(np.percentile(np.abs(dp), 99.9)) for _, dp, _ in series) or 1e-6
    bins = np.linspace(-reach, reach, _BINS + 1)
    figure = _figure(height=5.0)
    axes = figure.subplots()
    for label, dp, color in series:
        exact = int(np.count_nonzero(dp == 0))
        clipped = np.clip(dp, -reach, reach)
        axes.hist(clipped, bins=bins, histtype="step", linewidth=1.6, color=color,
                  label=f"{label}: RMS {math.sqrt(float(np.mean(dp * dp))):.2%}, {exact} of {dp.size} exactly 0")
    axes.set_yscale("log")
    axes.set_xlabel("Δp of the real next token (candidate or rerun minus baseline; tails clipped at 99.9%)")
    axes.set_ylabel("positions (log scale)")
    axes.xaxis.set_major_formatter(lambda value, _: f"{value:+.1%}")
    _finish(axes, title)
    _save(figure, path)


def kl_histogram(cand: LogprobComparison, floors: dict[str, LogprobComparison], title: str, path: Path) -> bool:
    """Per-position KL(base || run) on log-spaced bins, from the candidate's and each noise pass's
    comparison with the baseline; False when the dumps hold no distributions."""
    series = []
    for label, comparison, color in _series(cand, floors):
        if comparison.kl_values is None:
            return False
        series.append((label, np.asarray(comparison.kl_values), color, comparison.kl_kind))
    positive = np.concatenate([kl[kl > 0] for _, kl, _, _ in series])
    if positive.size == 0:
        positive = np.array([1e-12, 1e-6])
    low, high = max(float(positive.min()), 1e-12), float(positive.max())
    bins = np.logspace(math.log10(low), math.log10(max(high, low * 10)), _BINS + 1)
    figure = _figure(height=5.0)
    axes = figure.subplots()
    for label, kl, color, kind in series:
        zeros = int(np.count_nonzero(kl <= 0))
        axes.hist(np.clip(kl[kl > 0], low, None), bins=bins, histtype="step", linewidth=1.6, color=color,
                  label=f"{label}: mean {float(kl.mean()):.2e} ({kind}), {zeros} of {kl.size} exactly 0")
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("KL(baseline || run) per position, nats (log scale; positions with KL = 0 not drawn)")
    axes.set_ylabel("positions (log scale)")
    _finish(axes, title)
    _save(figure, path)
    return True


def flips_bars(candidate: AnswerComparison, floors: dict[str, AnswerComparison], allowed: float | None,
               title: str, path: Path) -> None:
    """Flips stacked by direction, the candidate next to each noise pass; the rule's allowance as a line.

    Stacked, because the flip rule limits the total: the bar's height is what the line judges.
    """
    groups = [("candidate", candidate), *((f"noise floor: {label}", c) for label, c in floors.items())]
    positions = np.arange(len(groups))
    figure = _figure(width=max(5.0, 1.8 * len(groups) + 2), height=4.6)
    axes = figure.subplots()
    right_to_wrong = np.array([c.right_to_wrong for _, c in groups])
    wrong_to_right = np.array([c.wrong_to_right for _, c in groups])
    axes.bar(positions, right_to_wrong, 0.55, color=CANDIDATE_COLOR, label="right → wrong")
    totals = axes.bar(positions, wrong_to_right, 0.55, bottom=right_to_wrong, color=FLOOR_COLORS[0],
                      label="wrong → right")
    axes.bar_label(totals, labels=[f"{a} + {b} = {a + b}" for a, b in zip(right_to_wrong, wrong_to_right)],
                   padding=3)
    if allowed is not None:
        axes.axhline(allowed, color="black", linestyle="--", linewidth=1.2,
                     label=f"candidate's allowance: {allowed:g} flips")
    axes.set_xticks(positions, [f"{name}\n{c.questions} questions" for name, c in groups])
    axes.set_ylabel("flipped questions")
    top = max(float((right_to_wrong + wrong_to_right).max()), allowed or 0, 1)
    axes.set_ylim(0, top * 1.25 + 0.5)
    axes.yaxis.get_major_locator().set_params(integer=True)
    _finish(axes, title)
    _save(figure, path)
