"""Each rule's false-alarm level and power, derived (exact sums, normal tails) and measured (seeded
simulation on synthetic paired answers and correlated figures), at GSM8K's 1,319 questions: the figures of
docs/validity.md, "False alarms and power of each rule". No engine; a few minutes on one core.

    .venv/bin/python benchmarks/error_budget.py > benchmarks/results/error-budget-simulation-cpu-DATE.txt
"""

from __future__ import annotations

import math
import platform
import sys
import time

import numpy as np

from pytest_fp8gate.core import rules
from pytest_fp8gate.core.answers import (
    detectable_drop,
    drop_fails_from,
    drop_power,
    flip_ratio_p,
    flip_rule_power,
    paired_drop_p,
)
from pytest_fp8gate.core.budget import (
    ACCURACY_SHARE,
    DETECTION_POWER,
    allowance_se,
    budget_weights,
    holm_levels,
    resolution_shift,
)

QUESTIONS, RIGHT = 1319, 1055  # GSM8K's test split at accuracy 0.80
MARGIN, ALPHA = 0.01, 0.05  # the paired rule's defaults; run_alpha's default
REPS = 4000
FAMILY = 9  # the demo's rules that are tests: paired accuracy, flips, 3 probability, 4 decode (gap included)
LOWEST = (1 - ACCURACY_SHARE) * ALPHA / (FAMILY - 1)  # a rule's lowest level under the budget, beside the paired


def simulated_paired(churn: float, drop: float, alpha: float, rng: np.random.Generator) -> float:
    """The paired rule's fail rate over REPS synthetic answer sheets, question by question."""
    right = np.arange(QUESTIONS) < RIGHT
    change = np.where(right, (churn / 2 + drop * QUESTIONS) / RIGHT, churn / 2 / (QUESTIONS - RIGHT))
    changed = rng.random((REPS, QUESTIONS)) < change
    to_wrong, to_right = (changed & right).sum(axis=1), (changed & ~right).sum(axis=1)
    fails_from = drop_fails_from(QUESTIONS, MARGIN, alpha)
    return float(np.mean(to_wrong >= np.array([fails_from(int(d)) for d in to_wrong + to_right])))


def paired_section(rng: np.random.Generator) -> None:
    print("## Paired accuracy (exact one-sided McNemar, margin 0.01), 1,319 questions, accuracy 0.80")
    print(f"{'level':>10} {'churn D':>8} {'true drop':>10} {'exact fail rate':>16} {'simulated':>10}"
          f" {'drop caught 80%':>16}")
    # Its own level, and its lowest under the budget: its first-step share of run_alpha.
    for alpha, label in ((ALPHA, "0.05"), (ACCURACY_SHARE * ALPHA, f"{ACCURACY_SHARE:g} x 0.05")):
        fails_from = drop_fails_from(QUESTIONS, MARGIN, alpha)
        for churn, drop in ((30, 0.02), (60, 0.02), (60, 0.01), (30, 0.01), (200, 0.0), (200, 0.02)):
            exact = drop_power(fails_from, QUESTIONS, churn / QUESTIONS, drop)
            simulated = simulated_paired(churn, drop, alpha, rng)
            caught = detectable_drop(fails_from, QUESTIONS, churn)
            print(f"{label:>10} {churn:>8} {drop:>10.2f} {exact:>16.4f} {simulated:>10.4f} {caught:>16.4f}")
    print()


def flips_section() -> None:
    print("## Flips, binomial rule (exact conditional test of <= 2 x the floor), floor of 30 flips in 1,319")
    floor_rate = 30 / QUESTIONS
    print(f"{'level':>10} {'passes':>6} {'allowance':>9} {'fail at 1x':>10} {'2x':>8} {'3x':>8}"
          f" {'rate caught 80%':>16}")
    for alpha, label in ((ALPHA, "0.05"), (LOWEST, f"{LOWEST:.4f}")):
        for passes in (1, 3):
            def allowed(f: int, alpha: float = alpha, passes: int = passes) -> float:
                return rules.flip_allowance(f, QUESTIONS, rule=rules.FLIP_BINOMIAL, alpha=alpha, floor_passes=passes)
            rates = [flip_rule_power(allowed, floor_rate, times * floor_rate, QUESTIONS, passes) for times in (1, 2, 3)]
            outcome = rules.flips_within_noise_floor(0, 30 * passes, QUESTIONS, rule=rules.FLIP_BINOMIAL, alpha=alpha,
                                                     floor_passes=passes)
            print(f"{label:>10} {passes:>6} {outcome.limit:>9g} {rates[0]:>10.4f} {rates[1]:>8.4f} {rates[2]:>8.4f}"
                  f" {outcome.figures['resolution']:>16.4f}")
    print()


def limit_section(rng: np.random.Generator) -> None:
    print("## A limit judged within k SE of the null (same top, RMS dp, PPL ratio, KL, decode, invalid rate,"
          " truncation)")
    print("Normal approximation: at the limit a rule fails P(Z > k); a figure (k + 0.84) SE past it fails 80%.")
    print(f"{'allowance':>22} {'k (SE)':>7} {'fail at limit':>14} {'simulated':>10} {'80% at (SE past)':>17}"
          f" {'simulated':>10}")
    se, limit = 1e-4, 1e-3
    for label, k in (("limit_se = 1 (own)", 1.0), ("Holm level 0.05", allowance_se(ALPHA)),
                     (f"Holm level {LOWEST:.4f}", allowance_se(LOWEST))):
        shift = resolution_shift(se, k)
        at_limit = limit + se * rng.standard_normal(REPS)
        past = limit + shift + se * rng.standard_normal(REPS)
        fail_at = np.mean([not rules.at_most("mean_kl", float(x), limit, measured_se=se, k_se=k).passed
                           for x in at_limit])
        fail_past = np.mean([not rules.at_most("mean_kl", float(x), limit, measured_se=se, k_se=k).passed
                             for x in past])
        print(f"{label:>22} {k:>7.3f} {1 - _phi(k):>14.4f} {fail_at:>10.4f} {shift / se:>17.3f} {fail_past:>10.4f}")
    print()


def _phi(z: float) -> float:
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def run_section(rng: np.random.Generator) -> None:
    print("## Per-run false alarms: N rules that are tests, each exactly at its limit (figures correlated rho)")
    print("Without the budget each limit rule allows 1 SE (15.9% at its limit); with it, Holm at run_alpha 0.05.")
    print(f"{'N':>3} {'rho':>4} {'without':>8} {'Holm 0.05':>10} {'budget':>7}")
    for n in (1, 2, 4, 7, 10, 14):
        for rho in (0.0, 0.5):
            z = math.sqrt(rho) * rng.standard_normal((REPS, 1)) + math.sqrt(1 - rho) * rng.standard_normal((REPS, n))
            without = float(np.mean((z > 1.0).any(axis=1)))
            p = 1 - np.vectorize(_phi)(z)
            holm = float(np.mean([any(p_row[i] <= level for i, level in
                                      holm_levels(dict(enumerate(p_row)), ALPHA).items()) for p_row in p]))
            print(f"{n:>3} {rho:>4.1f} {without:>8.4f} {holm:>10.4f} {ALPHA:>7.2f}")
    # The mixed family of the demo's kind: limits, the paired rule at D = 200 and the flip rule at 2 x its floor.
    fails = 0
    for _ in range(REPS):
        figures = rng.standard_normal(7)
        p = {f"limit{i}": 1 - _phi(float(x)) for i, x in enumerate(figures)}
        b = int(rng.binomial(200, 0.5))
        p["paired"] = paired_drop_p(b, 200 - b)
        floor, flips = int(rng.poisson(30)), int(rng.poisson(60))
        p["flips"] = flip_ratio_p(flips, floor, 2.0)
        levels = holm_levels(p, ALPHA, budget_weights(p, ["paired"], ACCURACY_SHARE))
        failed = any(p[f"limit{i}"] <= levels[f"limit{i}"] for i in range(7))
        failed |= b >= drop_fails_from(QUESTIONS, MARGIN, levels["paired"])(200)
        failed |= flips > rules.minimum_flip_allowance(QUESTIONS, 0.01) and p["flips"] < levels["flips"]
        fails += failed
    rate = fails / REPS
    upper = rate + 1.96 * math.sqrt(max(rate * (1 - rate), 1 / REPS) / REPS)
    print(f"mixed family of 9 (7 limits, paired at D = 200, flips at 2 x a floor of 30), Holm 0.05, the paired "
          f"rule weighted to {ACCURACY_SHARE:g}: "
          f"{rate:.4f} (95% upper {upper:.4f})")
    print()


def floor_ratio_section(rng: np.random.Generator) -> None:
    print("## floor_ratio = 20 with the floor's own SE (the demo's fp16 KL floor: 1.31e-5 +- 30%)")
    print("A build truly at T x the floor; its figure exact, the floor estimated with a 30% relative SE read")
    print("from the same estimate; limit_se 1. Before: the floor's SE not carried into ratio x floor.")
    print(f"{'T':>4} {'before':>8} {'after':>8} {f'after, Holm level {LOWEST:.4f}':>25}")
    true_floor = 1.31e-5
    estimates = np.abs(true_floor * (1 + 0.3 * rng.standard_normal(REPS)))
    for times in (12, 15, 18, 20, 25, 30, 40):
        rates = []
        for counted, k in ((False, 1.0), (True, 1.0), (True, allowance_se(LOWEST))):
            rates.append(np.mean([not rules.at_most(
                "mean_kl", times * true_floor, 1.0, floor_value=float(f), floor_ratio=20.0, measured_se=0.3 * float(f),
                k_se=k, floor_se=0.3 * float(f) if counted else 0.0).passed for f in estimates]))
        print(f"{times:>4} {rates[0]:>8.4f} {rates[1]:>8.4f} {rates[2]:>25.4f}")
    print()


def main() -> None:
    started = time.time()
    print(f"# error_budget.py: {REPS} draws per figure, seed 52; python {platform.python_version()}, "
          f"{platform.machine()}, numpy {np.__version__}; power quoted at {DETECTION_POWER:.0%}")
    print()
    rng = np.random.default_rng(52)
    paired_section(rng)
    flips_section()
    limit_section(rng)
    run_section(rng)
    floor_ratio_section(rng)
    print(f"# {time.time() - started:.0f} s")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
