"""Verdicts with a stated error budget (additions to the article, whose rules stay): the paired accuracy
rule's error rates by a seeded simulation of paired answers against its exact power sums, allowances counted
in the SE of a build with no real change, and noise passes pooled as repeated measurements. Pure functions on
synthetic data; no engine."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pytest_fp8gate.core import rules
from pytest_fp8gate.core.answers import detectable_drop, drop_fails_from, drop_power, flip_ratio_p
from pytest_fp8gate.core.logprobs import LogprobRun, compare_logprobs

# GSM8K's test split at the article's accuracy.
QUESTIONS, RIGHT = 1319, 1055  # 1055 / 1319 = 0.800
MARGIN, ALPHA = 0.01, 0.05  # the paired rule's defaults (TaskLimits.accuracy_margin, accuracy_alpha)
REPS = 4000


def simulated_fail_rate(churn: float, drop: float, seed: int) -> float:
    """How often the paired rule, at its defaults, fails a candidate that changes ``churn`` / 2 answers each way
    on average and, on top, loses ``drop`` x n right answers: REPS synthetic answer sheets, question by question."""
    rng = np.random.default_rng(seed)
    right = np.arange(QUESTIONS) < RIGHT
    # Per question: a right answer turns wrong, a wrong one right, with the rates that give that churn and drop.
    change = np.where(right, (churn / 2 + drop * QUESTIONS) / RIGHT, churn / 2 / (QUESTIONS - RIGHT))
    changed = rng.random((REPS, QUESTIONS)) < change
    to_wrong, to_right = (changed & right).sum(axis=1), (changed & ~right).sum(axis=1)
    fails_from = drop_fails_from(QUESTIONS, MARGIN, ALPHA)
    failed = to_wrong >= np.array([fails_from(int(d)) for d in to_wrong + to_right])
    # The rule itself decides as its failing region says (a sample of the draws, for time).
    for b, c, fail in list(zip(to_wrong, to_right, failed))[:10]:
        assert rules.paired_accuracy_within(int(b), int(c), QUESTIONS).passed is not bool(fail)
    return float(failed.mean())


def mc_tolerance(rate: float) -> float:
    return 4 * math.sqrt(rate * (1 - rate) / REPS) + 0.01  # 4 Monte Carlo SEs, and the two models' small gap


@pytest.mark.parametrize("churn, drop, seed", [(60, 0.02, 1), (60, 0.01, 2), (200, 0.0, 3), (30, 0.02, 4)])
def test_the_paired_rule_s_simulated_error_rates_match_its_exact_power(churn: int, drop: float, seed: int) -> None:
    simulated = simulated_fail_rate(churn, drop, seed)
    exact = drop_power(drop_fails_from(QUESTIONS, MARGIN, ALPHA), QUESTIONS, churn / QUESTIONS, drop)
    assert simulated == pytest.approx(exact, abs=mc_tolerance(exact))


def test_the_paired_rule_catches_two_points_and_holds_its_level_on_a_null() -> None:
    # docs/validity.md, "The paired accuracy rule": 1,319 questions at 0.80, 60 answers changing either way
    # (4.5%, FP8's flip rate in the demo and the article's example), and a null with 200 changing.
    assert simulated_fail_rate(60, 0.02, 5) >= 0.8
    one_point = simulated_fail_rate(60, 0.01, 6)
    assert 0.3 < one_point < 0.55  # the margin itself: a one-point drop is caught about half the time
    assert simulated_fail_rate(200, 0.0, 7) <= ALPHA


def test_a_drop_fails_when_past_the_margin_and_significant_and_not_otherwise() -> None:
    # 22 right->wrong, 8 wrong->right: 1.06 points down, one-sided p 0.008. The article's rule passes it
    # (one SE is 1.10 points); the paired rule does not.
    assert rules.accuracy_within_se(0.8, 0.8 - 14 / QUESTIONS, QUESTIONS).passed
    paired = rules.paired_accuracy_within(22, 8, QUESTIONS)
    assert not paired.passed and dict(paired.rows)["p, one-sided exact McNemar"] == pytest.approx(0.00806, abs=1e-5)
    assert dict(paired.rows)["paired SE, sqrt(D)/n"] == pytest.approx(math.sqrt(30) / QUESTIONS)
    # Significant but within the margin: 13 net of 1,319 is 0.99 points.
    assert rules.paired_accuracy_within(18, 5, QUESTIONS).passed
    assert rules.paired_accuracy_within(19, 5, QUESTIONS).figures["p_value"] < ALPHA
    assert not rules.paired_accuracy_within(19, 5, QUESTIONS).passed
    # Past the margin but not significant: 3 of 100 lost, p = 1/8.
    assert rules.paired_accuracy_within(3, 0, 100).passed and not rules.paired_accuracy_within(5, 0, 100).passed
    # No answer changed: nothing to fail on.
    assert rules.paired_accuracy_within(0, 0, QUESTIONS).passed
    # The threshold is the largest drop this run's changed answers pass.
    outcome = rules.paired_accuracy_within(22, 8, QUESTIONS)
    assert outcome.limit == pytest.approx(12 / QUESTIONS) and outcome.margin == pytest.approx(-2 / QUESTIONS)


def test_the_printed_resolution_is_the_drop_caught_with_80_percent_power() -> None:
    fails_from = drop_fails_from(QUESTIONS, MARGIN, ALPHA)
    resolution = rules.paired_accuracy_within(30, 30, QUESTIONS).figures["resolution"]
    assert resolution == detectable_drop(fails_from, QUESTIONS, 60)
    assert drop_power(fails_from, QUESTIONS, 60 / QUESTIONS, resolution) >= 0.8
    assert drop_power(fails_from, QUESTIONS, 60 / QUESTIONS, resolution - 0.001) < 0.8
    assert MARGIN < resolution < 0.02
    # More churn, less resolution.
    assert rules.paired_accuracy_within(100, 100, QUESTIONS).figures["resolution"] > resolution


def test_identical_runs_with_an_impossible_real_token_pass_every_probability_rule() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(200, 50))
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    top = np.argsort(-logprobs, axis=1)[:, :20]
    real = logprobs[:, 7].copy()
    real[5] = -np.inf  # the engine's log-prob of a token it gives no probability at all
    run = LogprobRun(real, top, np.take_along_axis(logprobs, top, axis=1), full_logprobs=logprobs)
    same = compare_logprobs(run, run)
    limits = {"same_top": 0.97674, "rms_dp": 0.01198, "mean_kl": 0.001355, "ppl_ratio": 1.000425}
    for name, limit in limits.items():
        outcome, _ = rules.BY_NAME[name].against_floors(name, same, {"batch-order": same}, limit, None,
                                                        "floor_ratio", 1.0)
        assert outcome.passed and outcome.margin >= 0, (name, outcome)


def test_the_invalid_rate_allowance_is_a_null_s_and_does_not_widen_as_the_candidate_worsens() -> None:
    # 50 questions, none invalid in the baseline, 2 points allowed: a candidate at 4% is beyond it.
    assert not rules.invalid_rate_within(0.0, 0.04, None, 50, 0.02, 1.0).passed
    slack = {rate: rules.invalid_rate_within(0.02, rate, None, 50, 0.02, 1.0).margin + rate
             for rate in (0.04, 0.1, 0.3)}
    assert len({round(value, 12) for value in slack.values()}) == 1  # margin falls one for one with the rate
    floor = rules.invalid_rate_within(0.02, 0.1, 0.04, 50, 0.02, 1.0)
    assert floor.margin == pytest.approx(0.04 - 0.1 + math.sqrt(0.04 * 0.96 / 50))


@pytest.mark.parametrize("name, worse", [("same_top", -0.01), ("mean_kl", 0.001), ("ppl_ratio", 0.001)])
def test_the_probability_allowance_is_the_noise_floor_s_and_does_not_widen(name: str, worse: float) -> None:
    rule = rules.BY_NAME[name]
    assert rule.se_field is not None and rule.ideal is not None
    floor = SimpleNamespace(**{"same_top": 0.999, name: rule.ideal + worse / 20, rule.se_field: 1e-4})
    limit = {"same_top": 0.97674, "mean_kl": 0.001355, "ppl_ratio": 1.000425}[name]
    slack = []
    for steps in (1, 2, 4):
        # Each worse candidate is noisier too; its own SE is not what the allowance is counted in.
        measured = limit + steps * worse
        candidate = SimpleNamespace(**{"same_top": 0.99, name: measured, rule.se_field: steps * 1e-3})
        outcome, _ = rule.against_floors(name, candidate, {"fp16": floor}, limit, None, "floor_ratio", 1.0)
        assert not outcome.passed
        slack.append(outcome.margin + math.copysign(1, worse) * (measured - limit))  # margin + the miss
    assert slack == pytest.approx([slack[0]] * 3, rel=1e-6)
    # Without a noise pass there is no allowance: the point estimate is judged.
    alone = SimpleNamespace(**{"same_top": 0.99, name: limit + worse / 1e3, rule.se_field: 1.0})
    lone, _ = rule.against_floors(name, alone, {}, limit, None, "floor_ratio", 1.0)
    assert not lone.passed


def test_noise_passes_pooled_give_a_tighter_flip_allowance_than_one() -> None:
    one = rules.flip_allowance(30, QUESTIONS, rule=rules.FLIP_BINOMIAL)
    two = rules.flip_allowance(60, QUESTIONS, rule=rules.FLIP_BINOMIAL, floor_passes=2)
    three = rules.flip_allowance(90, QUESTIONS, rule=rules.FLIP_BINOMIAL, floor_passes=3)
    assert (one, two, three) == (86, 80, 78)  # the same floor rate, measured once, twice, three times
    # Under H0 the candidate's share of all flips is ratio / (passes + ratio).
    assert flip_ratio_p(40, 60, 2.0, 2) == pytest.approx(
        sum(math.comb(100, k) * 0.5**100 for k in range(40, 101)))
    # The article's ratio rule reads the floor per pass.
    assert rules.flip_allowance(60, QUESTIONS, floor_passes=2) == 60
    pooled = rules.flips_within_noise_floor(84, 60, QUESTIONS, rule=rules.FLIP_BINOMIAL, floor_passes=2)
    assert not pooled.passed and rules.flips_within_noise_floor(84, 30, QUESTIONS, rule=rules.FLIP_BINOMIAL).passed
    assert pooled.figures["noise_floor"] == 30 and ("noise passes summed (addition)", 2) in pooled.rows
    # A second pass also sharpens the resolution: the flip rate caught with 80% power.
    assert pooled.figures["resolution"] < rules.flips_within_noise_floor(
        84, 30, QUESTIONS, rule=rules.FLIP_BINOMIAL).figures["resolution"]


def test_the_article_s_accuracy_rule_states_its_resolution_and_its_null_failure_rate() -> None:
    se = math.sqrt(0.8 * 0.2 / QUESTIONS)
    article = drop_fails_from(QUESTIONS, se)  # a drop past one SE fails, significant or not
    resolution = rules.accuracy_within_se(0.8, 0.79, QUESTIONS, discordant=60).figures["resolution"]
    assert resolution == detectable_drop(article, QUESTIONS, 60)
    assert drop_power(article, QUESTIONS, 60 / QUESTIONS, resolution) >= 0.8
    assert "resolution" not in rules.accuracy_within_se(0.8, 0.79, QUESTIONS).figures  # no churn given, none stated
    # Why the paired rule is added beside it: with 200 answers changing both ways and no real drop, the article's
    # rule fails an equally good build about 15% of the time; the paired rule at most alpha.
    assert drop_power(article, QUESTIONS, 200 / QUESTIONS, 0.0) == pytest.approx(0.153, abs=0.005)
    assert drop_power(drop_fails_from(QUESTIONS, MARGIN, ALPHA), QUESTIONS, 200 / QUESTIONS, 0.0) <= ALPHA


def test_the_paired_rule_s_settings_are_checked_by_name(tmp_path) -> None:
    from pytest_fp8gate.config.loader import load_config
    from pytest_fp8gate.errors import ConfigError

    example = (Path(__file__).parent.parent / "thresholds.toml").read_text(encoding="utf-8")
    assert "accuracy_alpha = 0.05" in example
    path = tmp_path / "thresholds.toml"
    path.write_text(example.replace("accuracy_alpha = 0.05", "accuracy_alpha = 0.7"), encoding="utf-8")
    with pytest.raises(ConfigError, match=r"thresholds.toml: tasks\[0\].limits.accuracy_alpha: expected a number in "
                                          r"\(0, 0.5\], got 0.7"):
        load_config(path)


def test_noise_passes_that_disagree_are_not_pooled() -> None:
    from pytest_fp8gate.core.answers import pooled_floor

    assert pooled_floor([30, 30, 30])[:2] == (90, 3)  # one rate, measured three times
    assert pooled_floor([20, 30])[:2] == (50, 2)  # within chance of one rate (p 0.2)
    # A batch-invariant engine's batch-order pass (0 flips) beside an FP16 one (8 of the same questions): two
    # kinds of noise, p = 2 x 0.5^8; the worst pass alone is the floor, as the article's single pass.
    flips, passes, p = pooled_floor([0, 8])
    assert (flips, passes) == (8, 1) and p == pytest.approx(2 / 256)
    assert pooled_floor([5]) == (5, 1, 1.0) and pooled_floor([]) == (0, 1, 1.0)
