from __future__ import annotations

import math

import pytest

from pytest_fp8gate.rules import (
    accuracy_within_se,
    at_least,
    at_most,
    flips_within_noise_floor,
    speed_at_least_fraction,
)

# The article's GSM8K example: 1,319 questions at about 82%, one SE = 1.06 points.
GSM8K_N = 1319
GSM8K_SE = math.sqrt(0.82 * 0.18 / GSM8K_N)


def test_accuracy_drop_inside_one_se_passes():
    outcome = accuracy_within_se(0.82, 0.8116, GSM8K_N)
    assert outcome.passed
    assert outcome.limit == pytest.approx(0.82 - GSM8K_SE)
    assert outcome.margin == pytest.approx(0.8116 - (0.82 - GSM8K_SE))
    assert dict(outcome.rows)["standard error"] == pytest.approx(GSM8K_SE)


def test_accuracy_drop_beyond_one_se_fails():
    outcome = accuracy_within_se(0.82, 0.805, GSM8K_N)
    assert not outcome.passed
    assert outcome.margin < 0


def test_accuracy_rise_passes_one_sided_but_fails_two_sided():
    assert accuracy_within_se(0.82, 0.84, GSM8K_N).passed
    two_sided = accuracy_within_se(0.82, 0.84, GSM8K_N, two_sided=True)
    assert not two_sided.passed
    assert two_sided.limit == pytest.approx(0.82 + GSM8K_SE)


def test_accuracy_k_widens_the_band():
    assert accuracy_within_se(0.82, 0.805, GSM8K_N, k=2.0).passed


def test_accuracy_rejects_percentages():
    with pytest.raises(ValueError, match="fraction"):
        accuracy_within_se(82.0, 81.0, GSM8K_N)


def test_flips_within_twice_the_floor_pass():
    outcome = flips_within_noise_floor(flips=30, floor_flips=16, questions=GSM8K_N)
    assert outcome.passed
    assert (outcome.limit, outcome.margin) == (32.0, 2.0)


def test_flips_beyond_twice_the_floor_fail():
    outcome = flips_within_noise_floor(flips=33, floor_flips=16, questions=GSM8K_N)
    assert not outcome.passed
    assert outcome.margin == -1.0


def test_zero_floor_gets_minimum_allowance():
    # 1% of 1,319 questions rounds up to 14 allowed flips.
    assert flips_within_noise_floor(14, 0, GSM8K_N).passed
    assert not flips_within_noise_floor(15, 0, GSM8K_N).passed
    # Even a tiny test set tolerates one flip, unless the allowance is off.
    assert flips_within_noise_floor(1, 0, 20).passed
    assert not flips_within_noise_floor(1, 0, 20, min_allowance_fraction=0.0).passed


def test_minimum_allowance_does_not_round_up_float_noise():
    # 0.01 * 300 is 3.0000000000000004 in floating point.
    assert flips_within_noise_floor(3, 0, 300).limit == 3.0


def test_same_top_at_least_reference_and_floor_ratio():
    # Floor disagreement 0.26% (BF16 vs FP16); 2x floor allows 0.52%.
    ok = at_least("same_top", 0.9955, 0.97674, floor_value=0.9974, floor_ratio=2.0)
    assert ok.passed and ok.limit == pytest.approx(1 - 2 * 0.0026)
    assert dict(ok.rows)["noise floor"] == 0.9974
    failing = at_least("same_top", 0.990, 0.97674, floor_value=0.9974, floor_ratio=2.0)
    assert not failing.passed
    assert failing.margin == pytest.approx(0.990 - (1 - 2 * 0.0026))


def test_same_top_below_absolute_reference_fails():
    outcome = at_least("same_top", 0.96, 0.97674)
    assert not outcome.passed and outcome.rule == "same_top"


def test_floor_at_the_ideal_leaves_only_the_reference():
    # A deterministic engine gives same_top 1.0 on the floor run.
    outcome = at_least("same_top", 0.99, 0.97674, floor_value=1.0, floor_ratio=2.0)
    assert outcome.passed and outcome.limit == 0.97674


def test_at_most_kl_and_rms_dp():
    assert at_most("mean_kl", 0.0010, 0.001355).passed
    assert not at_most("mean_kl", 0.0020, 0.001355).passed
    capped = at_most("rms_dp", 0.010, 0.01198, floor_value=0.004, floor_ratio=2.0)
    assert not capped.passed and capped.limit == pytest.approx(0.008)


def test_ppl_ratio_distance_is_measured_from_one():
    outcome = at_most("ppl_ratio", 1.0006, 1.001, floor_value=1.0004, floor_ratio=2.0, ideal=1.0)
    assert outcome.limit == pytest.approx(1.0008) and outcome.passed
    assert not at_most("ppl_ratio", 1.0009, 1.001, 1.0004, 2.0, ideal=1.0).passed


def test_a_limit_missed_within_k_standard_errors_passes_and_beyond_fails():
    # The demo's fp8_per_channel: PPL ratio 1.000718 with SE 0.000341 against Q8_0's 1.000425.
    within = at_most("ppl_ratio", 1.000718, 1.000425, ideal=1.0, measured_se=0.000341, k_se=1.0)
    assert within.passed and within.margin == pytest.approx(0.000341 - 0.000293)
    assert ("candidate SE (fails beyond 1 SE)", 0.000341) in within.rows
    assert not at_most("ppl_ratio", 1.000718, 1.000425, ideal=1.0, measured_se=0.000341, k_se=0.0).passed
    assert not at_most("ppl_ratio", 1.0028, 1.000425, ideal=1.0, measured_se=0.0004, k_se=1.0).passed
    assert not at_least("same_top", 0.96, 0.97674, measured_se=0.003, k_se=1.0).passed
    assert at_least("same_top", 0.975, 0.97674, measured_se=0.003, k_se=1.0).passed


def test_floor_ratio_without_floor_is_an_error():
    with pytest.raises(ValueError, match="floor_value"):
        at_most("mean_kl", 0.001, 0.002, floor_ratio=2.0)


def test_speed_at_least_eighty_percent_of_ceiling():
    # The article: 46 tok/s is 80% of the L40S BF16 ceiling of 57.6 tok/s.
    assert speed_at_least_fraction(46.1, 57.6).passed
    slow = speed_at_least_fraction(40.0, 57.6)
    assert not slow.passed
    assert slow.margin == pytest.approx(40.0 - 0.8 * 57.6)
    assert dict(slow.rows)["measured fraction"] == pytest.approx(40.0 / 57.6)


def test_outcome_rows_end_with_threshold_and_margin_and_serialise():
    outcome = speed_at_least_fraction(90.0, 107.6)
    assert [label for label, _ in outcome.rows[-2:]] == ["threshold", "margin"]
    plain = outcome.as_dict()
    assert plain["passed"] is True and plain["rows"][-1] == ["margin", outcome.margin]
