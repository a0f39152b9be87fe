from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_fp8gate.core.answers import (
    AnswerRecord,
    compare_answers,
    detectable_flip_rate,
    flip_ratio_p,
    flip_rule_power,
    mcnemar_exact_p,
)
from pytest_fp8gate.core.logprobs import PERCENTILES, TOPK_KL, LogprobRun, compare_logprobs, kl_per_position
from pytest_fp8gate.core.rules import BY_NAME
from pytest_fp8gate.errors import ComparisonError


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))


def run_from_full(full: np.ndarray, real_ids: np.ndarray, k: int, keep_full: bool) -> LogprobRun:
    order = np.argsort(-full, axis=1, kind="stable")[:, :k]
    return LogprobRun(
        real_logprob=full[np.arange(len(full)), real_ids],
        top_ids=order,
        top_logprobs=np.take_along_axis(full, order, axis=1),
        full_logprobs=full if keep_full else None,
    )


def pair(n=40, vocab=60, k=8, noise=0.3, seed=0, keep_full=True):
    """Baseline and candidate full distributions plus their runs."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(scale=3.0, size=(n, vocab))
    base_full = log_softmax(logits)
    cand_full = log_softmax(logits + rng.normal(scale=noise, size=logits.shape))
    real = rng.integers(0, vocab, n)
    return (
        base_full,
        cand_full,
        run_from_full(base_full, real, k, keep_full),
        run_from_full(cand_full, real, k, keep_full),
    )


def reference_kl(base_full: np.ndarray, cand_full: np.ndarray) -> list[float]:
    return [
        sum(math.exp(lp) * (lp - lq) for lp, lq in zip(p_row, q_row))
        for p_row, q_row in zip(base_full.tolist(), cand_full.tolist())
    ]


def test_exact_kl_is_sum_p_log_p_over_q():
    base_full, cand_full, base, cand = pair()
    result = compare_logprobs(base, cand)
    expected = reference_kl(base_full, cand_full)
    assert result.kl_kind == "exact"
    assert result.mean_kl == pytest.approx(np.mean(expected), rel=1e-12)
    assert result.kl_se == pytest.approx(np.std(expected, ddof=1) / math.sqrt(len(expected)))
    assert result.kl_percentiles["max"] == pytest.approx(max(expected), rel=1e-12)
    assert result.kl_percentiles["median"] == pytest.approx(np.median(expected), rel=1e-12)


def test_topk_lower_bound_never_exceeds_exact_kl_per_position():
    base_full, cand_full, base, cand = pair(k=5, noise=0.8, seed=3, keep_full=False)
    exact = reference_kl(base_full, cand_full)
    for i, exact_kl in enumerate(exact):
        rows = slice(i, i + 1)
        one_base = LogprobRun(base.real_logprob[rows], base.top_ids[rows], base.top_logprobs[rows])
        one_cand = LogprobRun(cand.real_logprob[rows], cand.top_ids[rows], cand.top_logprobs[rows])
        bound = compare_logprobs(one_base, one_cand)
        assert bound.kl_kind == "top-k lower bound"
        assert 0.0 <= bound.mean_kl <= exact_kl + 1e-12


def test_topk_lower_bound_is_tight_when_tail_mass_is_tiny():
    rng = np.random.default_rng(7)
    n, k = 50, 6
    logits = np.concatenate(
        [rng.normal(size=(n, k)), np.full((n, 4), -40.0)], axis=1
    )  # tokens outside the top-k hold ~1e-17 of the mass
    base_full = log_softmax(logits)
    cand_full = log_softmax(logits + np.pad(rng.normal(scale=0.2, size=(n, k)), ((0, 0), (0, 4))))
    real = rng.integers(0, k, n)
    base = run_from_full(base_full, real, k, keep_full=False)
    cand = run_from_full(cand_full, real, k, keep_full=False)
    result = compare_logprobs(base, cand)
    assert result.mean_kl == pytest.approx(np.mean(reference_kl(base_full, cand_full)), abs=1e-9)


def _random_pair(seed: int) -> tuple[np.ndarray, np.ndarray, int, float]:
    """A baseline and a candidate distribution over a random vocabulary, sharp or flat, the candidate a
    perturbation of the baseline, an unrelated model, or the baseline on other ids (disjoint top-k); and
    the rounding their log-probs carry (float32 ones do not sum to 1 exactly, so neither is the exact KL)."""
    rng = np.random.default_rng(seed)
    vocab = int(rng.choice([4, 10, 60, 259, 2000]))
    k = int(rng.integers(1, min(vocab, 50) + 1))
    scale = float(rng.choice([0.3, 1.0, 3.0, 8.0]))
    base = log_softmax(rng.normal(scale=scale, size=(30, vocab)))
    kind = seed % 3
    if kind == 0:
        cand = log_softmax(base + rng.normal(scale=float(rng.choice([0.05, 0.5, 3.0])), size=base.shape))
    elif kind == 1:
        cand = log_softmax(rng.normal(scale=scale, size=base.shape))
    else:
        cand = np.roll(base, vocab // 2, axis=1)
    if seed % 4 == 0:  # float32 log-probs, as engines return them
        base, cand = (log_softmax(x).astype(np.float32).astype(np.float64) for x in (base, cand))
        return base, cand, k, 1e-6
    return base, cand, k, 1e-12


def _bound(base_full: np.ndarray, cand_full: np.ndarray, k: int) -> np.ndarray:
    real = np.zeros(len(base_full), dtype=np.int64)
    kind, kl = kl_per_position(run_from_full(base_full, real, k, False), run_from_full(cand_full, real, k, False))
    assert kind == TOPK_KL and kl is not None
    return kl


@pytest.mark.parametrize("seeds", [range(start, start + 100) for start in range(0, 400, 100)],
                         ids=lambda seeds: f"seeds-{seeds.start}")
def test_topk_bound_is_never_above_the_exact_kl_of_random_distributions(seeds):
    for seed in seeds:
        base, cand, k, rounding = _random_pair(seed)
        exact = np.array(reference_kl(base, cand))
        bound = _bound(base, cand, k)
        assert (bound >= 0).all()
        assert (bound <= exact + rounding * (1 + exact)).all(), (seed, float((bound - exact).max()))


def test_topk_bound_equals_the_exact_kl_when_the_sets_agree_and_the_tails_are_alike():
    # The candidate moves only the top-k ids' logits, too little to change the set: the rest of the vocabulary
    # keeps its shape, so one bucket of it loses nothing and the bound is the exact KL.
    rng = np.random.default_rng(4)
    n, vocab, k = 200, 300, 20
    logits = rng.normal(size=(n, vocab))
    logits[:, :k] += 8.0
    shift = np.zeros_like(logits)
    shift[:, :k] = rng.normal(scale=0.3, size=(n, k))
    base, cand = log_softmax(logits), log_softmax(logits + shift)
    bound = _bound(base, cand, k)
    assert bound == pytest.approx(reference_kl(base, cand), rel=1e-9, abs=1e-14)
    assert bound.min() > 0


def test_topk_bound_is_zero_only_where_the_reported_sets_agree():
    base, cand, _, _ = _random_pair(1)  # an unrelated model
    assert (_bound(base, base, 8) == 0).all()
    assert (_bound(base, cand, 8) > 1e-3).all()
    # Another id order, the same probabilities: the distributions differ, so does the bound.
    assert (_bound(base, np.roll(base, 1, axis=1), 8) > 1e-3).all()


def test_topk_bound_is_large_when_the_top_k_sets_share_no_id():
    # A sharp model against itself on other ids: the one-bucket bound read ~0 here. With k = 1 a
    # candidate whose top id holds the baseline's top mass could put that mass on the baseline's id,
    # so only larger k can prove much; the bound grows with k.
    rng = np.random.default_rng(0)
    base = log_softmax(rng.normal(scale=4.0, size=(100, 259)))
    cand = np.roll(base, 129, axis=1)
    exact = float(np.mean(reference_kl(base, cand)))
    means = [float(_bound(base, cand, k).mean()) for k in (1, 5, 20, 50)]
    assert means == sorted(means) and means[0] > 0.2
    assert min(means[1:]) > 1.0 and means[-1] > 0.3 * exact
    # The served fake's geometric distribution (p of rank r ~ e^-r) shifted: nearly all its top-k mass moves.
    fake = np.log(1 - math.exp(-1.0)) - np.arange(259.0)
    geometric = np.tile(fake, (4, 1))
    assert _bound(geometric, np.roll(geometric, 129, axis=1), 5).min() > 4.0


def test_logprobs_on_base_ids_fill_in_ids_missing_from_candidate_top_k():
    base_full, cand_full, base, cand = pair(k=4, noise=1.0, seed=5, keep_full=False)
    on_base = np.take_along_axis(cand_full, base.top_ids, axis=1)
    informed = LogprobRun(
        cand.real_logprob, cand.top_ids, cand.top_logprobs, logprobs_on_base_ids=on_base
    )
    matched = compare_logprobs(base, cand).mean_kl
    finer = compare_logprobs(base, informed).mean_kl
    exact = float(np.mean(reference_kl(base_full, cand_full)))
    # A finer partition can only raise the bound, and it stays below the exact KL.
    assert matched <= finer + 1e-12 <= exact + 2e-12
    assert finer > matched  # noise 1.0 reorders the top-4, so ids were missing


@pytest.mark.parametrize(("vocab", "k"), [(60, 8), (400, 300)])  # 300: wider than uint8
def test_matching_inside_candidate_top_k_equals_masked_given_logprobs(vocab, k):
    _, cand_full, base, cand = pair(n=5, vocab=vocab, k=k, noise=0.5, keep_full=False)
    present = np.array([np.isin(b, c) for b, c in zip(base.top_ids, cand.top_ids)])
    assert not present.all()  # some baseline ids left the candidate's top-k
    on_base = np.where(present, np.take_along_axis(cand_full, base.top_ids, axis=1), np.nan)
    given = LogprobRun(
        cand.real_logprob, cand.top_ids, cand.top_logprobs, logprobs_on_base_ids=on_base
    )
    assert compare_logprobs(base, cand).kl_percentiles == pytest.approx(
        compare_logprobs(base, given).kl_percentiles, abs=1e-15
    )


def test_identical_runs_agree_perfectly():
    _, _, base, _ = pair(keep_full=False)
    result = compare_logprobs(base, base)
    summary = (result.same_top, result.rms_dp, result.ppl_ratio, result.mean_kl)
    assert summary == (1.0, 0.0, 1.0, 0.0)


def test_kl_from_float_error_is_clamped_to_zero():
    base_full, _, base, _ = pair()
    # float32 round trip: tiny differences both ways, which sum to about +-1e-9.
    rounded = base_full.astype(np.float32).astype(np.float64)
    cand = LogprobRun(base.real_logprob, base.top_ids, base.top_logprobs, full_logprobs=rounded)
    assert compare_logprobs(base, cand).kl_percentiles["min"] >= 0.0
    cand_topk = LogprobRun(base.real_logprob, base.top_ids, base.top_logprobs.astype(np.float32))
    assert compare_logprobs(base, cand_topk).kl_percentiles["min"] >= 0.0


def test_kl_unavailable_without_top_logprobs():
    ids = np.array([[3], [4]])
    nan = np.full((2, 1), np.nan)
    base = LogprobRun(np.array([-1.0, -2.0]), ids, nan)
    cand = LogprobRun(np.array([-1.5, -2.0]), np.array([[3], [5]]), nan)
    result = compare_logprobs(base, cand)
    assert (result.kl_kind, result.mean_kl, result.kl_se, result.kl_percentiles) == (
        "unavailable",
        None,
        None,
        None,
    )
    assert result.same_top == 0.5
    assert result.as_dict()["mean_kl"] is None


def test_summary_statistics_and_percentile_labels():
    _, _, base, cand = pair(n=500, seed=11, keep_full=False)
    result = compare_logprobs(base, cand)
    dp = np.exp(cand.real_logprob) - np.exp(base.real_logprob)
    same = (base.top_ids[:, 0] == cand.top_ids[:, 0]).mean()
    assert result.same_top_se == pytest.approx(math.sqrt(same * (1 - same) / 500))
    assert result.mean_dp == pytest.approx(dp.mean())
    assert result.mean_dp_se == pytest.approx(dp.std(ddof=1) / math.sqrt(500))
    assert result.ln_ppl_ratio == pytest.approx(math.log(result.ppl_ratio))
    assert list(result.dp_percentiles) == [label for label, _ in PERCENTILES]
    assert list(result.dp_percentiles)[:2] == ["max", "99.9%"]
    assert result.dp_percentiles["1%"] == pytest.approx(np.percentile(dp, 1))
    assert result.dp_percentiles["min"] == pytest.approx(dp.min())
    plain = result.as_dict()
    assert type(plain["positions"]) is int and type(plain["rms_dp"]) is float


def test_standard_errors_of_the_gated_metrics_match_a_bootstrap():
    # The SEs the rules use (RMS Δp by the delta method, the mean log-ratio behind the PPL ratio)
    # against the spread of the metric itself over bootstrap resamples of positions: limit_se leans on them.
    _, _, base, cand = pair(n=4000, seed=5, keep_full=True)
    result = compare_logprobs(base, cand)
    rng = np.random.default_rng(0)
    samples = {"same_top": [], "rms_dp": [], "ln_ppl_ratio": [], "mean_kl": []}  # ppl_ratio is judged in logs
    for _ in range(300):
        rows = rng.integers(0, 4000, 4000)
        resampled = compare_logprobs(*(LogprobRun(r.real_logprob[rows], r.top_ids[rows], r.top_logprobs[rows],
                                                  full_logprobs=r.full_logprobs[rows]) for r in (base, cand)))
        for metric, values in samples.items():
            values.append(getattr(resampled, metric))
    for metric, values in samples.items():
        se_field = BY_NAME[metric.removeprefix("ln_")].se_field
        assert getattr(result, se_field) == pytest.approx(np.std(values), rel=0.2), metric


def zeros_run(n: int = 4, k: int = 3, **extra) -> LogprobRun:
    return LogprobRun(np.zeros(n), np.zeros((n, k)), np.zeros((n, k)), **extra)


@pytest.mark.parametrize(
    ("cand", "message"),
    [
        (zeros_run(n=3), "candidate has 3"),
        (zeros_run(logprobs_on_base_ids=np.zeros((4, 2))), "baseline's top-k shape"),
        (zeros_run(token_ids=[1, 2, 9, 4]), "position 2"),
    ],
)
def test_incomparable_runs_raise(cand, message):
    base = zeros_run(token_ids=[1, 2, 3, 4])
    with pytest.raises(ComparisonError, match=message):
        compare_logprobs(base, cand)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"top_ids": np.zeros((4, 3)), "top_logprobs": np.zeros((4, 2))}, "same shape"),
        ({"top_ids": np.zeros((5, 3)), "top_logprobs": np.zeros((5, 3))}, "5 positions"),
        ({"top_ids": np.zeros(4), "top_logprobs": np.zeros(4)}, "2-D"),
        ({"top_ids": np.zeros((4, 0)), "top_logprobs": np.zeros((4, 0))}, "at least one column"),
        (
            {"top_ids": np.zeros((4, 1)), "top_logprobs": np.zeros((4, 1)), "token_ids": [1]},
            "token_ids has 1 positions",
        ),
    ],
)
def test_malformed_run_raises_value_error(fields, message):
    with pytest.raises(ValueError, match=message):
        LogprobRun(real_logprob=np.zeros(4), **fields)


def test_real_logprob_nan_is_rejected():
    with pytest.raises(ComparisonError, match="NaN"):
        LogprobRun(np.array([0.0, np.nan]), np.zeros((2, 1)), np.zeros((2, 1)))


def answer(doc_id, correct, response="1", prompt_hash="h", filter="strict-match"):
    return AnswerRecord(doc_id, filter, correct, f"{prompt_hash}{doc_id}", response, "7")


@pytest.mark.parametrize(
    ("b", "c", "p"),
    [
        (1, 9, 0.021484375),
        (9, 1, 0.021484375),
        (0, 0, 1.0),
        (3, 3, 1.0),
        (0, 5, 0.0625),
        (2, 0, 0.5),
    ],
)
def test_mcnemar_exact_known_values(b, c, p):
    assert mcnemar_exact_p(b, c) == pytest.approx(p, abs=1e-15)


def test_mcnemar_stays_exact_for_many_flips():
    # Two-sided binomial tail of 1000 vs 1100 at p=1/2, computed independently.
    n, low = 2100, 1000
    tail = sum(math.comb(n, i) for i in range(low + 1))
    assert mcnemar_exact_p(1000, 1100) == pytest.approx(2 * tail / 2**n, rel=1e-12)
    assert 0.02 < mcnemar_exact_p(1000, 1100) < 0.04


def test_compare_answers_counts_flips_both_ways():
    base = [answer(i, correct) for i, correct in enumerate([1, 1, 1, 0, 0, 1, 0, 1])]
    cand_correct = [1, 0, 1, 1, 0, 0, 0, 1]
    cand = [answer(i, c, response=f"r{i}") for i, c in enumerate(cand_correct)]
    result = compare_answers(base, cand)
    assert (result.questions, result.flips, result.right_to_wrong, result.wrong_to_right) == (
        8,
        3,
        2,
        1,
    )
    assert result.accuracy_base == 5 / 8 and result.accuracy_cand == 4 / 8
    assert result.se_base == pytest.approx(math.sqrt(5 / 8 * 3 / 8 / 8))
    assert result.mcnemar_p == mcnemar_exact_p(2, 1) == 1.0
    assert [(f.doc_id, f.direction, f.cand_response) for f in result.flipped] == [
        (1, "right_to_wrong", "r1"),
        (3, "wrong_to_right", "r3"),
        (5, "right_to_wrong", "r5"),
    ]
    assert result.as_dict()["flipped"][0] == {
        "doc_id": 1,
        "base_response": "1",
        "cand_response": "r1",
        "target": "7",
        "direction": "right_to_wrong",
    }


def test_answers_pair_by_doc_and_filter_not_by_order():
    base = [answer(0, True), answer(1, False), answer(0, False, filter="flexible-extract")]
    cand = list(reversed(base))
    result = compare_answers(base, cand)
    assert (result.questions, result.flips) == (3, 0)


def test_prompt_hash_mismatch_raises_naming_the_doc():
    base = [answer(0, True), answer(1, True)]
    cand = [answer(0, True), answer(1, True, prompt_hash="other")]
    with pytest.raises(ComparisonError, match="doc_id 1: prompt_hash differs"):
        compare_answers(base, cand)


@pytest.mark.parametrize(
    ("base_ids", "cand_ids", "message"),
    [
        ([0, 1, 2], [0, 2], "doc_id 1 .* missing from candidate"),
        ([0, 2], [0, 1, 2], "doc_id 1 .* missing from baseline"),
        ([0, 0], [0, 0], "doc_id 0 twice"),
        ([], [], "no answers"),
    ],
)
def test_different_question_sets_raise(base_ids, cand_ids, message):
    with pytest.raises(ComparisonError, match=message):
        compare_answers([answer(i, True) for i in base_ids], [answer(i, True) for i in cand_ids])


# ---- flip-rule uncertainty ----------------------------------------------------


def test_flip_ratio_p_is_the_upper_binomial_tail_of_the_candidates_share():
    # 8 of 10 flips from the candidate, H0 share 2/3: P(X >= 8) for Binomial(10, 2/3).
    expected = sum(math.comb(10, i) * (2 / 3) ** i * (1 / 3) ** (10 - i) for i in range(8, 11))
    assert flip_ratio_p(8, 2, 2.0) == pytest.approx(expected)
    assert flip_ratio_p(0, 0, 2.0) == 1.0
    assert flip_ratio_p(3, 0, 2.0) == pytest.approx((2 / 3) ** 3)


def test_flip_ratio_p_falls_as_the_candidate_flips_more():
    values = [flip_ratio_p(c, 5, 2.0) for c in range(0, 40)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[10] > 0.5 and values[30] < 0.01


def test_flip_rule_power_matches_a_simulation_of_both_counts():
    rng = np.random.default_rng(7)
    floor = rng.binomial(100, 0.02, 200_000)
    cand = rng.binomial(100, 0.08, 200_000)
    simulated = float(np.mean(cand > np.maximum(2 * floor, 1)))
    assert flip_rule_power(lambda f: max(2 * f, 1), 0.02, 0.08, 100) == pytest.approx(simulated, abs=0.005)


def test_detectable_flip_rate_is_where_power_reaches_the_target_and_shrinks_with_questions():
    rule = lambda f: max(2 * f, 1)  # noqa: E731
    rate = detectable_flip_rate(rule, 0.02, 100)
    assert flip_rule_power(rule, 0.02, rate, 100) >= 0.8 > flip_rule_power(rule, 0.02, rate - 0.002, 100)
    assert detectable_flip_rate(rule, 0.02, 1000) < rate
    assert detectable_flip_rate(lambda f: 100, 0.02, 100) == math.inf
