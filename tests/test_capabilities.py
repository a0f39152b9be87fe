"""Engine capabilities read from vLLM's API, and the fallbacks when one is missing (no engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from pytest_fp8gate import capabilities
from pytest_fp8gate.capabilities import UnsupportedEngine, detect, version_note, version_tuple
from pytest_fp8gate.config import load_config
from pytest_fp8gate.demo.run import demo_config_text
from pytest_fp8gate.engine import Engine, IdScoringUnavailable
from pytest_fp8gate.gate import Case, Gate
from pytest_fp8gate.logprobs import TOPK_KL, LogprobRun
from pytest_fp8gate.measure import Measurements, ModelResult, PassResult

# SamplingParams fields as each release declares them (the part that matters here).
FIELDS_0_26 = ("max_tokens", "prompt_logprobs", "flat_logprobs", "detokenize")
FIELDS_0_33 = (*FIELDS_0_26, "prompt_logprob_token_ids")


def test_vllm_0_26_lacks_id_scoring_and_says_so():
    caps = detect("0.26.0", FIELDS_0_26)
    assert not caps.scores_given_ids
    assert "0.26.0" in caps.id_scoring_missing and "prompt_logprob_token_ids" in caps.id_scoring_missing
    assert detect("0.33.0", FIELDS_0_33).scores_given_ids


def test_a_release_without_flat_logprobs_is_refused_with_the_supported_range():
    with pytest.raises(UnsupportedEngine, match="flat_logprobs.*0.26 to 0.33"):
        detect("0.10.0", ("max_tokens", "prompt_logprobs"))


def test_versions_older_than_the_range_get_a_note():
    assert version_tuple("0.26.0+cu130") == (0, 26, 0)
    assert version_tuple("0.33.0rc1") == (0, 33, 0)
    assert version_note("0.25.1") is not None
    assert version_note("0.26.0") is None and version_note("0.34.0.dev3") is None


def test_installed_vllm_is_detected():
    pytest.importorskip("vllm")
    caps = capabilities.detect_installed()
    assert caps.vllm_version and caps.as_dict()["scores_given_ids"] is caps.scores_given_ids


def test_engine_never_sends_a_keyword_its_release_lacks():
    engine = object.__new__(Engine)  # no vLLM engine: the refusal comes before any call
    engine.capabilities = detect("0.26.0", FIELDS_0_26)
    with pytest.raises(IdScoringUnavailable, match="added in vLLM 0.33"):
        engine.logprobs_on_ids([[1, 2, 3]], np.zeros((2, 4), dtype=np.int64))


class _EngineWithoutIdScoring:
    def __init__(self) -> None:
        self.calls = 0

    def logprobs_on_ids(self, chunks, ids):
        self.calls += 1
        raise IdScoringUnavailable(detect("0.26.0", FIELDS_0_26).id_scoring_missing)


TOKENS = np.random.default_rng(7).integers(0, 1000, 50)


def _run(rng: np.random.Generator, k: int = 5, vocab: int = 1000) -> LogprobRun:
    positions, tokens = len(TOKENS), TOKENS
    logits = rng.normal(size=(positions, vocab))
    logprobs = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    order = np.argsort(-logprobs, axis=1)[:, :k]
    return LogprobRun(logprobs[np.arange(positions), tokens], order,
                      np.take_along_axis(logprobs, order, axis=1), token_ids=tokens)


@pytest.fixture
def measurements(tmp_path: Path) -> Measurements:
    config_path = tmp_path / "thresholds.toml"
    config_path.write_text(demo_config_text({}), encoding="utf-8")
    lines: list[str] = []
    found = Measurements(load_config(config_path), tmp_path, {}, lines.append)
    found.lines = lines  # type: ignore[attr-defined]
    return found


def test_missing_id_scoring_falls_back_once_and_labels_the_kl(measurements: Measurements):
    rng = np.random.default_rng(0)
    base, cand = _run(rng), _run(rng)
    spec = measurements.config.baseline
    measurements._baseline = ModelResult(spec, PassResult("main", logprobs=base), 1.0, None, 1000)
    engine = _EngineWithoutIdScoring()
    assert measurements._with_base_ids(engine, cand) is cand  # the measurement is kept, not lost
    assert measurements._with_base_ids(engine, cand) is cand
    assert engine.calls == 1  # the refusal is remembered for the rest of the session
    assert "prompt_logprob_token_ids" in measurements.id_scoring_refusal
    assert any("KL uses the ids each model returned" in line for line in measurements.lines)

    measurements._candidates["fp8-per-channel"] = ModelResult(
        measurements.config.candidates[0], PassResult("main", logprobs=cand), 1.0, None, 1000)
    verdict = Gate(measurements.config, measurements).probability(Case("mean_kl", "fp8-per-channel"))
    assert verdict.details["comparison"]["kl_kind"] == TOPK_KL
    kl_note = next(note for note in verdict.notes if note.startswith("KL(base || candidate)"))
    assert "candidate's own top-k" in kl_note and "added in vLLM 0.33" in kl_note


def test_id_scoring_where_available_is_used(measurements: Measurements):
    rng = np.random.default_rng(1)
    base, cand = _run(rng), _run(rng)
    measurements._baseline = ModelResult(measurements.config.baseline, PassResult("main", logprobs=base),
                                         1.0, None, 1000)

    class Scoring:
        def logprobs_on_ids(self, chunks, ids):
            return np.full(ids.shape, -3.0)

    scored = measurements._with_base_ids(Scoring(), cand)
    assert measurements.id_scoring_refusal is None
    assert np.array_equal(scored.logprobs_on_base_ids, np.full(base.top_ids.shape, -3.0))
    assert dataclasses.replace(scored, logprobs_on_base_ids=None).positions == cand.positions
