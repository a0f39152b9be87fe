"""The probability figures' SEs clustered by sequence: coverage on correlated positions, and the iid twins."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pytest_fp8gate.core.buckets import chunk_positions
from pytest_fp8gate.core.logprobs import LogprobRun, clustered_se, compare_logprobs, sequence_clusters

CHUNKS, PER_CHUNK = 20, 200


def _correlated_sample(rng: np.random.Generator) -> np.ndarray:
    """Positions of CHUNKS texts: each text shifts its own level (between-chunk spread), and neighbours
    share an AR(1) drift inside it, as a candidate's per-position KL does on real text."""
    level = rng.normal(0.0, 0.3, CHUNKS)
    rows = []
    for chunk in range(CHUNKS):
        drift = np.empty(PER_CHUNK)
        drift[0] = rng.normal()
        for i in range(1, PER_CHUNK):
            drift[i] = 0.9 * drift[i - 1] + math.sqrt(1 - 0.81) * rng.normal()
        rows.append(level[chunk] + 0.8 * drift)
    return np.concatenate(rows)


def test_the_clustered_se_covers_the_spread_of_correlated_positions_and_the_iid_se_does_not() -> None:
    rng = np.random.default_rng(7)
    clusters = np.repeat(np.arange(CHUNKS), PER_CHUNK)
    covered_clustered = covered_iid = 0
    replicates = 400
    for _ in range(replicates):
        values = _correlated_sample(rng)  # the true mean is 0
        iid = float(values.std(ddof=1)) / math.sqrt(values.size)
        covered_clustered += abs(values.mean()) <= 1.96 * clustered_se(values, clusters, iid)
        covered_iid += abs(values.mean()) <= 1.96 * iid
    # CR1 with 20 clusters sits a little under 95% (its t has 19 degrees of freedom); the iid SE is several
    # times too narrow on these positions.
    assert 0.88 <= covered_clustered / replicates <= 0.98
    assert covered_iid / replicates < 0.6


def test_singleton_clusters_give_the_iid_se_and_one_cluster_falls_back_to_it() -> None:
    values = np.random.default_rng(1).normal(size=500)
    iid = float(values.std(ddof=1)) / math.sqrt(values.size)
    assert clustered_se(values, np.arange(values.size), iid) == pytest.approx(iid)
    assert clustered_se(values, np.zeros(values.size, dtype=np.int64), 0.123) == 0.123


def test_sequences_are_read_off_the_positions() -> None:
    assert sequence_clusters(chunk_positions(6, 4)).tolist() == [0, 0, 0, 1, 1, 1]
    assert sequence_clusters(np.array([3, 4, 5, 2, 3, 9, 1])).tolist() == [0, 0, 0, 1, 1, 1, 2]


def _runs(rng: np.random.Generator, positions: int) -> tuple[LogprobRun, LogprobRun]:
    vocab = 50
    base_logits = rng.normal(size=(positions, vocab))
    # Whole chunks drift apart together: the candidate's error has a level per chunk.
    chunk_shift = np.repeat(rng.normal(0, 0.6, positions // 99 + 1), 99)[:positions, None]
    cand_logits = base_logits + chunk_shift * rng.normal(size=(1, vocab)) + rng.normal(0, 0.1, (positions, vocab))

    def run(logits: np.ndarray) -> LogprobRun:
        full = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        top = np.argsort(-full, axis=1)[:, :5]
        real = full[np.arange(positions), np.arange(positions) % vocab]
        return LogprobRun(real, top, np.take_along_axis(full, top, axis=1), full_logprobs=full)

    return run(base_logits), run(cand_logits)


def test_the_comparison_carries_both_ses_and_the_clustered_one_is_the_wider_on_drifting_chunks() -> None:
    base, cand = _runs(np.random.default_rng(3), 99 * 8)
    result = compare_logprobs(base, cand, chunk_positions(99 * 8, 100))
    figures = result.as_dict()
    assert figures["clusters"] == 8
    for name in ("same_top_se", "mean_dp_se", "rms_dp_se", "ln_ppl_ratio_se", "kl_se"):
        assert figures[f"{name}_iid"] > 0
    assert result.kl_se is not None and result.kl_se_iid is not None
    assert result.kl_se > 1.5 * result.kl_se_iid
    # Without positions nothing says where a sequence ends: the iid SEs, as llama.cpp reports them.
    alone = compare_logprobs(base, cand)
    assert alone.clusters == 1 and alone.kl_se == alone.kl_se_iid and alone.same_top_se == alone.same_top_se_iid


def test_identical_runs_with_an_impossible_real_token_have_a_ppl_ratio_of_one() -> None:
    base, _ = _runs(np.random.default_rng(4), 99)
    real = base.real_logprob.copy()
    real[5] = -np.inf
    impossible = LogprobRun(real, base.top_ids, base.top_logprobs)
    result = compare_logprobs(impossible, impossible)
    assert result.ppl_ratio == 1.0 and result.ln_ppl_ratio_se == 0.0
