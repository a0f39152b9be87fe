"""Speed under load at a served endpoint: output tok/s and TTFT/TPOT percentiles at each concurrency.

An in-process client (threads over ``EndpointClient``'s streamed completions) rather than
``vllm bench serve``: it needs no second tool's version on the runner, reuses the gate's
key, TLS and redirect rules, sends token ids (so BF16 and FP8 get the same prompts, whatever
the tokenizer does to text) and works against any OpenAI-compatible server. It measures what
``vllm bench serve`` reports: per request TTFT (first streamed token) and TPOT ((last - first)
/ (output tokens - 1)); per level the output tokens of all requests over the level's wall time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from .http_client import EndpointClient


@dataclass(frozen=True)
class LoadLevel:
    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-12)

    def percentile(self, values: Sequence[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": self.requests, "wall_s": self.wall_s,
                "output_tok_s": self.output_tok_s,
                "ttft_p50_s": self.percentile(self.ttft_s, 50), "ttft_p99_s": self.percentile(self.ttft_s, 99),
                "tpot_p50_s": self.percentile(self.tpot_s, 50), "tpot_p99_s": self.percentile(self.tpot_s, 99)}


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
                  output_len: int, vocab_size: int, seed: int = 0) -> LoadLevel:
    """``requests`` streamed requests of random prompt ids, ``concurrency`` in flight at a time."""
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


def throughput_fractions(candidate: Sequence[LoadLevel], baseline: Sequence[LoadLevel]) -> dict[int, float]:
    """Candidate output tok/s over the baseline's at each concurrency both measured."""
    base = {level.concurrency: level.output_tok_s for level in baseline}
    return {level.concurrency: level.output_tok_s / base[level.concurrency]
            for level in candidate if base.get(level.concurrency)}
