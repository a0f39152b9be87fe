"""Speed under load at a served endpoint: output tok/s and TTFT/TPOT percentiles at each concurrency.

An in-process client (threads over ``EndpointClient``'s streamed completions) rather than
``vllm bench serve``: it needs no second tool's version on the runner, reuses the gate's
key, TLS and redirect rules, sends token ids (so BF16 and FP8 get the same prompts, whatever
the tokenizer does to text) and works against any OpenAI-compatible server. It measures what
``vllm bench serve`` reports: per request TTFT (first streamed token) and TPOT ((last - first)
/ (output tokens - 1)); per level the output tokens of all requests over the level's wall time.
The rule that judges the levels (``rules.throughput_under_load``) is in the pure core.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from .http_client import EndpointClient
from .rules import LoadLevel
from .spec import LoadSpec

WARMUP_TOKENS = 8  # a warm-up level's output: it only has to reach every batch size once


def _one(client: EndpointClient, body: dict[str, Any]) -> tuple[float, float, int]:
    """(TTFT, TPOT, output tokens) of one streamed request."""
    started = time.perf_counter()
    first = last = None
    tokens = 0
    for at, event in client.stream("/v1/completions", body):
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids")
            count = len(ids) if ids is not None else (1 if choice.get("text") else 0)
            if count:
                first = first or at
                last = at
                tokens += count
    if first is None or last is None:
        return float("nan"), float("nan"), 0
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return first - started, tpot, tokens


def measure_level(client: EndpointClient, model: str, concurrency: int, requests: int, input_len: int,
                  output_len: int, vocab_size: int, seed: int | Sequence[int] = 0) -> LoadLevel:
    """``requests`` streamed requests of random prompt ids, ``concurrency`` in flight at a time.

    The same ``seed`` gives the same prompts, so a baseline and its candidate are sent alike; a
    second measurement of one server needs another seed, or its prefix cache serves the prompts."""
    rng = np.random.default_rng(seed)
    bodies = [{"model": model, "prompt": rng.integers(0, min(vocab_size, 10000), input_len).tolist(),
               "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0, "stream": True,
               "return_token_ids": True} for _ in range(requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        results = list(pool.map(lambda body: _one(client, body), bodies))
    wall = time.perf_counter() - started
    return LoadLevel(concurrency, requests, wall, sum(r[2] for r in results),
                     tuple(r[0] for r in results if r[2]), tuple(r[1] for r in results if r[2] > 1))


def measure_levels(client: EndpointClient, model: str, spec: LoadSpec, vocab_size: int,
                   seed: int = 0) -> list[LoadLevel]:
    """Every level of ``spec``, after a short warm-up at the highest concurrency. Each level draws its
    prompts from its own seed (``seed`` and its concurrency), so no level's prompts are in the prefix
    cache from an earlier one; the same ``seed`` sends a baseline and its candidate the same prompts."""
    top = max(spec.concurrencies)
    measure_level(client, model, top, top, spec.input_len, WARMUP_TOKENS, vocab_size, seed=(seed, 0))
    return [measure_level(client, model, c, spec.requests_at(c), spec.input_len, spec.output_len, vocab_size,
                          seed=(seed, c)) for c in spec.concurrencies]
