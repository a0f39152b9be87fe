"""Engine capabilities read from vLLM's API, and the fallbacks when one is missing (no engine)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pytest_fp8gate.engines import capabilities
from pytest_fp8gate.engines.capabilities import UnsupportedEngine, detect, version_note, version_tuple
from pytest_fp8gate.engines.vllm_engine import VllmEngine

# SamplingParams fields as each release declares them (the part that matters here).
from pytest_fp8gate.errors import IdScoringUnavailable

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


@pytest.mark.engine
def test_installed_vllm_is_detected():
    pytest.importorskip("vllm")
    caps = capabilities.detect_installed()
    assert caps.vllm_version and caps.as_dict()["scores_given_ids"] is caps.scores_given_ids


def test_engine_never_sends_a_keyword_its_release_lacks():
    engine = object.__new__(VllmEngine)  # no vLLM engine: the refusal comes before any call
    engine.capabilities = detect("0.26.0", FIELDS_0_26)
    with pytest.raises(IdScoringUnavailable, match="added in vLLM 0.33"):
        engine.logprobs_on_ids([[1, 2, 3]], np.zeros((2, 4), dtype=np.int64))


# A Sapphire Rapids class CPU: AMX tiles and AMX-INT8, no AMX-FP8.
AMX_INT8_ONLY = frozenset({"avx512f", "amx_tile", "amx_bf16", "amx_int8"})


def test_per_channel_fp8_is_refused_where_torch_hands_its_matmul_to_onednns_reference_kernel(tmp_path) -> None:
    from pytest_fp8gate.engines.capabilities import cpu_engine_refusal
    from pytest_fp8gate.tools.fp8_writer import SCHEMES, quantization_config

    refusal = cpu_engine_refusal("model", "fp8_per_channel", flags=AMX_INT8_ONLY)
    assert refusal is not None and refusal.startswith("quantization = 'fp8_per_channel': ")
    assert "AMX-INT8 and no AMX-FP8" in refusal
    # vLLM's own W8A8 kernel where the CPU has AMX-FP8; torch's fast emulation where it has no AMX-INT8.
    assert cpu_engine_refusal("model", "fp8_per_channel", flags=AMX_INT8_ONLY | {"amx_fp8"}) is None
    assert cpu_engine_refusal("model", "fp8_per_channel", flags=frozenset({"avx2", "avx512f", "avx512_bf16"})) is None
    # The same layers from a checkpoint: the project's FP8-dynamic writer's config (per-channel weights).
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": quantization_config(
        SCHEMES["fp8-dynamic"])}))
    refusal = cpu_engine_refusal(str(tmp_path), None, flags=AMX_INT8_ONLY)
    assert refusal is not None and refusal.startswith(f"{tmp_path / 'config.json'}: FP8 weights per channel: ")
    assert cpu_engine_refusal(str(tmp_path), None, flags=frozenset({"avx2"})) is None
    # A BF16 model, or a BF16 model with an FP8 KV cache, runs there.
    assert cpu_engine_refusal("model", None, "fp8", flags=AMX_INT8_ONLY) is None
