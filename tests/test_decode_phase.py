"""The engine-free core of the decode phase: rows of generated positions, the comparisons and their
additions (reverse KL, acceptance, first departure), and the answers' length and validity."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pytest_fp8gate.core import rules
from pytest_fp8gate.core.answers import AnswerRecord, invalid_rate, is_invalid, length_drift
from pytest_fp8gate.core.decode_phase import (
    TOPK_ACCEPTANCE,
    DecodeRun,
    acceptance_per_position,
    compare_decode,
    first_departures,
    generated_rows,
    reverse_kl_per_position,
)
from pytest_fp8gate.core.logprobs import TOPK_KL, LogprobRun, kl_per_position
from pytest_fp8gate.engines.capabilities import cpu_engine_refusal
from pytest_fp8gate.errors import ComparisonError

VOCAB = 12


def _rows(logits: np.ndarray, tokens: np.ndarray, top_k: int | None = None) -> LogprobRun:
    full = logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)
    top = np.argsort(-full, axis=1, kind="stable")[:, :top_k or VOCAB]
    return LogprobRun(full[np.arange(len(tokens)), tokens], top, np.take_along_axis(full, top, axis=1),
                      full_logprobs=None if top_k else full, token_ids=tokens)


def _pair(noise: float, top_k: int | None = None, n: int = 300, seed: int = 0) -> tuple[DecodeRun, LogprobRun]:
    """A baseline decode run of three continuations (its greedy tokens) and a candidate's rows on them."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, VOCAB)) * 2
    tokens = logits.argmax(axis=1)
    lengths = (n // 3, n // 3, n - 2 * (n // 3))
    bounds = np.cumsum((0, *lengths))
    generated = tuple(tuple(int(t) for t in tokens[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    base = DecodeRun(((1, 2), (3,), (4, 5, 6)), generated, _rows(logits, tokens, top_k))
    cand = _rows(logits + np.random.default_rng(seed + 1).normal(size=logits.shape) * noise, tokens, top_k)
    return base, cand


def test_the_rows_of_a_prefill_that_predict_the_generated_tokens() -> None:
    prompts, generated = ((7, 8, 9), (1,)), ((3, 4), (5, 6, 2))
    sequences = [p + g for p, g in zip(prompts, generated)]
    tokens = np.concatenate([np.asarray(s[1:]) for s in sequences])
    prefill = _rows(np.random.default_rng(0).normal(size=(len(tokens), VOCAB)), tokens)
    rows = generated_rows(prefill, [3, 1], [2, 3])
    assert rows.token_ids.tolist() == [3, 4, 5, 6, 2]  # type: ignore[union-attr]
    assert np.array_equal(rows.full_logprobs, prefill.full_logprobs[[2, 3, 4, 5, 6]])  # type: ignore[index]
    with pytest.raises(ComparisonError, match="prefill has 7 rows, the sequences 8"):
        generated_rows(prefill, [3, 2], [2, 3])


def test_identical_runs_agree_on_every_figure() -> None:
    base, _ = _pair(0.0)
    same = compare_decode(base, base.logprobs)
    assert same.logprobs.same_top == 1.0 and same.logprobs.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert same.mean_reverse_kl == pytest.approx(0.0, abs=1e-12)
    assert same.acceptance_rate == pytest.approx(1.0)
    assert same.departed == 0 and same.first_departures == (None, None, None)
    assert same.mean_first_departure == pytest.approx(100.0)  # censored at each length


def test_the_exact_reverse_kl_and_acceptance_are_their_definitions() -> None:
    base, cand = _pair(0.5)
    p, q = np.exp(base.logprobs.full_logprobs), np.exp(cand.full_logprobs)  # type: ignore[arg-type]
    kind, reverse = reverse_kl_per_position(base.logprobs, cand)
    assert kind == "exact" and np.allclose(reverse, (q * np.log(q / p)).sum(axis=1))
    kind, acceptance = acceptance_per_position(base.logprobs, cand)
    assert kind == "exact" and np.allclose(acceptance, 1 - 0.5 * np.abs(p - q).sum(axis=1))  # 1 - TV
    comparison = compare_decode(base, cand)
    assert 0 < comparison.acceptance_rate < 1 and comparison.mean_reverse_kl > 0  # type: ignore[operator]
    # The verdict's details go into the JSON report as they are: no per-position arrays.
    assert json.loads(json.dumps(comparison.as_dict()))["logprobs"]["mean_kl"] == comparison.logprobs.mean_kl


@pytest.mark.parametrize("top_k", [1, 3, 6])
def test_top_k_figures_are_bounds_on_the_exact_ones_on_the_same_side(top_k: int) -> None:
    base, cand = _pair(0.5)
    base_k, cand_k = _pair(0.5, top_k)
    assert kl_per_position(base_k.logprobs, cand_k)[0] == TOPK_KL
    exact, bound = compare_decode(base, cand), compare_decode(base_k, cand_k)
    assert bound.reverse_kl_kind == TOPK_KL and bound.acceptance_kind == TOPK_ACCEPTANCE
    # Lower bounds, position by position: a coarser partition (KL), fewer tokens summed (acceptance).
    for measure in (reverse_kl_per_position, acceptance_per_position):
        assert (measure(base_k.logprobs, cand_k)[1] <= measure(base.logprobs, cand)[1] + 1e-12).all()
    assert bound.logprobs.mean_kl <= exact.logprobs.mean_kl  # type: ignore[operator]
    assert bound.logprobs.same_top == exact.logprobs.same_top  # the top-1 is known either way


def test_the_first_departure_is_where_the_candidates_greedy_choice_leaves_the_text() -> None:
    base, _ = _pair(0.0)
    cand = base.logprobs
    top = cand.top_ids.copy()
    top[100 + 7, 0] = (top[100 + 7, 0] + 1) % VOCAB  # the second continuation, its 8th token
    departed = LogprobRun(cand.real_logprob, top, cand.top_logprobs, token_ids=cand.token_ids)
    assert first_departures(base, departed) == [None, 7, None]


def test_a_decode_run_must_hold_one_row_per_generated_token() -> None:
    base, _ = _pair(0.0)
    with pytest.raises(ComparisonError, match="300 log-prob rows for 299 generated tokens"):
        DecodeRun(base.prompts, (*base.generated[:2], base.generated[2][:-1]), base.logprobs)
    with pytest.raises(ComparisonError, match="not of the generated tokens"):
        DecodeRun(base.prompts, (base.generated[1], base.generated[0], base.generated[2]), base.logprobs)


def _answer(response: str) -> AnswerRecord:
    return AnswerRecord(doc_id=0, filter="strict-match", correct=False, prompt_hash=None, response=response, target="")


def test_an_invalid_answer_is_lm_evals_fallback_or_nothing() -> None:
    assert is_invalid(_answer("[invalid]")) and is_invalid(_answer("  ")) and not is_invalid(_answer("12"))
    assert invalid_rate([_answer("[invalid]"), _answer("3"), _answer("4"), _answer("")]) == 0.5


def test_length_drift_is_the_change_of_the_mean_length_over_shared_questions() -> None:
    assert length_drift({1: "aaaa", 2: "bb"}, {1: "aaaaaa", 2: "bbb", 3: "ignored"}) == pytest.approx(0.5)
    with pytest.raises(ComparisonError, match="no question in common"):
        length_drift({1: "a"}, {2: "a"})


def test_the_output_sanity_rules_pass_and_fail() -> None:
    assert rules.length_drift_within(0.05, 0.01, 0.10, 2.0).passed
    assert not rules.length_drift_within(-0.15, 0.01, 0.10, 2.0).passed
    assert rules.length_drift_within(-0.15, 0.08, 0.10, 2.0).passed  # the floor drifts 8%: 2 x 8% allowed
    assert rules.invalid_rate_within(0.02, 0.03, 0.02, 500, 0.01, 1.0).passed
    failed = rules.invalid_rate_within(0.02, 0.10, 0.02, 500, 0.01, 1.0)
    assert not failed.passed and failed.limit == pytest.approx(0.03)
    assert rules.invalid_rate_within(0.02, 0.10, 0.09, 500, 0.01, 1.0).passed  # a noise pass rose as much


def test_an_fp8_kv_cache_is_refused_on_a_cpu_without_avx512_or_amx() -> None:
    refusal = cpu_engine_refusal("model", None, "fp8", flags=frozenset({"avx", "avx2"}))
    assert refusal is not None and "AVX-512 or AMX" in refusal
    assert cpu_engine_refusal("model", None, "fp8", flags=frozenset({"avx2", "avx512f"})) is None
    assert cpu_engine_refusal("model", None, "fp8_e5m2", flags=frozenset({"amx_tile"})) is None
    assert cpu_engine_refusal("model", None, "auto", flags=frozenset()) is None
