from __future__ import annotations

import math

import pytest

from pytest_fp8gate.core.rules import (
    FLIP_BINOMIAL,
    RESOLUTION_ROW,
    SHARE_OF_CEILING,
    DecodeSpeed,
    accuracy_within_se,
    at_least,
    at_most,
    decode_speed,
    flip_allowance,
    flip_margin_se,
    flips_within_noise_floor,
    is_overhead_bound,
    ratio_at_most,
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


def test_binomial_rule_fails_a_planted_regression_the_counts_prove():
    # The demo's noscale plant flips 16 of 100 against a floor of 2: p = 0.033 < 0.05.
    outcome = flips_within_noise_floor(16, 2, 100, rule=FLIP_BINOMIAL)
    assert not outcome.passed and outcome.rule == "flips"  # the variant is in its rows, not a second name
    rows = dict(outcome.rows)
    assert rows["p, exact test of flips <= 2 x floor (addition)"] < 0.05
    assert rows["test level alpha"] == 0.05
    assert outcome.limit == 14.0 and outcome.margin == -2.0


def test_binomial_rule_passes_what_the_counts_cannot_tell_apart():
    # 8 flips against a floor of 2 fails the article's 2x rule, but p = 0.30: two
    # small Poisson counts cannot tell 4x the floor from 2x.
    assert not flips_within_noise_floor(8, 2, 100).passed
    assert flips_within_noise_floor(8, 2, 100, rule=FLIP_BINOMIAL).passed


def test_binomial_rule_keeps_the_minimum_allowance_and_fails_flips_on_a_zero_floor():
    # With a floor of 0 the test rejects at (2/3)^c < 0.05, i.e. from 8 flips on.
    assert flip_allowance(0, 100, rule=FLIP_BINOMIAL) == 7.0
    assert not flips_within_noise_floor(8, 0, 100, rule=FLIP_BINOMIAL).passed
    # A minimum allowance above the test's bound still applies.
    assert flip_allowance(0, 1000, rule=FLIP_BINOMIAL) == 10.0


def test_binomial_allowance_never_admits_a_count_the_test_rejects():
    for floor in range(0, 30, 3):
        allowed = int(flip_allowance(floor, 500, rule=FLIP_BINOMIAL, min_allowance_fraction=0.0))
        assert flips_within_noise_floor(allowed, floor, 500, rule=FLIP_BINOMIAL, min_allowance_fraction=0.0).passed
        assert not flips_within_noise_floor(allowed + 1, floor, 500, rule=FLIP_BINOMIAL,
                                            min_allowance_fraction=0.0).passed


def test_flip_verdicts_report_the_margin_in_standard_errors_and_the_resolution():
    outcome = flips_within_noise_floor(8, 2, 100)
    rows = dict(outcome.rows)
    # (2 x 0.02 - 0.08) / sqrt(0.08 x 0.92 / 100 + 4 x 0.02 x 0.98 / 100)
    expected = (0.04 - 0.08) / math.sqrt(0.08 * 0.92 / 100 + 4 * 0.02 * 0.98 / 100)
    assert rows["margin in SE of the rates (addition)"] == pytest.approx(expected)
    assert flip_margin_se(0, 0, 100, 2.0) == math.inf
    # The binomial rule trades false alarms for resolution: it needs a larger true rate.
    assert rows[RESOLUTION_ROW] < dict(flips_within_noise_floor(8, 2, 100, rule=FLIP_BINOMIAL).rows)[RESOLUTION_ROW]


def test_unknown_flip_rule_is_an_error():
    with pytest.raises(ValueError, match="rule must be one of"):
        flip_allowance(2, 100, rule="poisson")


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


def test_ppl_ratio_distance_is_measured_from_one_in_logs():
    outcome = ratio_at_most("ppl_ratio", 1.0006, 1.001, floor_value=1.0004, floor_ratio=2.0)
    assert outcome.limit == pytest.approx(1.0004 ** 2) and outcome.passed
    assert outcome.limit_key == "floor_ratio" and outcome.figures["noise_floor"] == 1.0004
    assert not ratio_at_most("ppl_ratio", 1.0009, 1.001, 1.0004, 2.0).passed
    assert ratio_at_most("ppl_ratio", 0.5, 1.001).passed  # a candidate that predicts the text better


def test_a_limit_missed_within_k_standard_errors_passes_and_beyond_fails():
    # The demo's fp8_per_channel: PPL ratio 1.000718 with SE 0.000341 of its log against Q8_0's 1.000425.
    within = ratio_at_most("ppl_ratio", 1.000718, 1.000425, measured_se=0.000341, k_se=1.0)
    assert within.passed and within.margin == pytest.approx(1.000425 * math.exp(0.000341) - 1.000718)
    assert ("SE of ln noise floor (fails beyond 1 SE)", 0.000341) in within.rows
    assert (within.measured, within.limit) == (1.000718, 1.000425)  # shown as ratios
    assert not ratio_at_most("ppl_ratio", 1.000718, 1.000425, measured_se=0.000341, k_se=0.0).passed
    assert not ratio_at_most("ppl_ratio", 1.0028, 1.000425, measured_se=0.0004, k_se=1.0).passed
    assert not at_least("same_top", 0.96, 0.97674, measured_se=0.003, k_se=1.0).passed
    assert at_least("same_top", 0.975, 0.97674, measured_se=0.003, k_se=1.0).passed


def test_a_huge_ppl_ratio_fails_whatever_its_standard_error():
    # Another model served under the name: PPL ratio 6.18e7, mean log-ratio 17.9 with a wide spread. Carried
    # to the ratio, one SE (ratio x SE of the log) cleared a limit of 1.01; in logs it misses by ~17 nats.
    outcome = ratio_at_most("ppl_ratio", 6.18e7, 1.01, measured_se=0.9, k_se=1.0)
    assert not outcome.passed and outcome.margin < -6e7
    assert not ratio_at_most("ppl_ratio", math.inf, 1.01, measured_se=50.0, k_se=1.0).passed


def test_floor_ratio_without_floor_is_an_error():
    with pytest.raises(ValueError, match="floor_value"):
        at_most("mean_kl", 0.001, 0.002, floor_ratio=2.0)


# H200, vLLM 0.26.0, 8B shape (shared/gpu/README.md): BF16 206.2 of 317.6 tok/s (65%),
# online fp8_per_channel 278.8 of 587.7 tok/s (47%), 1.35x where the bytes allow 1.85x.
H200_BF16 = DecodeSpeed(206.2, 317.6)
H200_FP8 = DecodeSpeed(278.8, 587.7)


def test_healthy_fp8_passes_against_the_baseline_share_and_fails_the_articles_fixed_share():
    relative = decode_speed(H200_FP8, H200_BF16)
    assert relative.passed and relative.rule == "speed"
    rows = dict(relative.rows)
    assert rows["measured speedup"] == pytest.approx(278.8 / 206.2)
    assert rows["speedup the bytes allow"] == pytest.approx(587.7 / 317.6)
    # The share ratio is the measured speedup over the speedup the bytes allow.
    assert relative.measured == pytest.approx(rows["measured speedup"] / rows["speedup the bytes allow"])
    assert relative.measured == pytest.approx(H200_FP8.share / H200_BF16.share)
    fixed = decode_speed(H200_FP8, H200_BF16, rule=SHARE_OF_CEILING)
    assert not fixed.passed and fixed.margin == pytest.approx(H200_FP8.share - 0.8)


def test_fp8_that_realises_none_of_its_byte_savings_fails():
    # Planted: FP8 weights dequantized to BF16 at load run at BF16's speed.
    no_gain = decode_speed(DecodeSpeed(206.2, 587.7), H200_BF16)
    assert not no_gain.passed
    assert no_gain.measured == pytest.approx(1 / (587.7 / 317.6))


def test_article_rule_on_the_l40s():
    # The article: 46 tok/s is 80% of the L40S BF16 ceiling of 57.6 tok/s.
    base = DecodeSpeed(46.1, 57.6)
    assert decode_speed(DecodeSpeed(86.1, 107.6), base, rule=SHARE_OF_CEILING).passed
    slow = decode_speed(DecodeSpeed(80.0, 107.6), base, rule=SHARE_OF_CEILING)
    assert not slow.passed and slow.measured == pytest.approx(80.0 / 107.6)


def test_overhead_bound_model_is_judged_against_the_baseline_tok_s_not_a_ceiling():
    # The embedded model on the H200: 617 tok/s against a "ceiling" of 600,615.
    base = DecodeSpeed(617.0, 600_615.0)
    same = decode_speed(DecodeSpeed(600.0, 1_150_000.0), base)
    assert same.passed and same.measured == pytest.approx(600 / 617)
    assert dict(same.rows)["overhead-bound below share"] == 0.1
    slower = decode_speed(DecodeSpeed(300.0, 1_150_000.0), base, rule=SHARE_OF_CEILING)
    assert not slower.passed and slower.limit == 0.5  # the rule choice does not apply without a ceiling
    assert is_overhead_bound(base, 0.1) and not is_overhead_bound(H200_BF16, 0.1)


def test_decode_speed_refuses_impossible_figures():
    for tok_s, ceiling in ((0.0, 10.0), (10.0, 0.0), (float("nan"), 10.0), (10.0, float("inf"))):
        with pytest.raises(ValueError):
            DecodeSpeed(tok_s, ceiling)
    with pytest.raises(ValueError, match="rule must be one of"):
        decode_speed(H200_FP8, H200_BF16, rule="fastest")


def test_outcome_rows_end_with_threshold_and_margin_and_serialise():
    outcome = decode_speed(H200_FP8, H200_BF16)
    assert [label for label, _ in outcome.rows[-2:]] == ["threshold", "margin"]
    plain = outcome.as_dict()
    assert plain["passed"] is True and plain["rows"][-1] == ["margin", outcome.margin]
