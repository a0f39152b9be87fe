"""Speed under load at a served endpoint: output tok/s and TTFT/TPOT percentiles at each concurrency.

An in-process client (``fan_out``'s threads over ``EndpointClient``'s streamed completions) rather than
``vllm bench serve``: it needs no second tool's version on the runner, reuses the gate's
key, TLS and redirect rules, sends token ids (so BF16 and FP8 get the same prompts, whatever
the tokenizer does to text) and works against any OpenAI-compatible server. It measures what
``vllm bench serve`` reports: per request TTFT (first streamed token) and TPOT ((last - first)
/ (output tokens - 1)); per level the output tokens of all requests over the level's wall time.
The rule that judges the levels (``rules.throughput_under_load``) is in the pure core.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..config.spec import LoadSpec
from ..core.rules import LoadLevel
from ..errors import EndpointError, EndpointTimeout
from .fan_out import fan_out
from .http_client import EndpointClient

# A server's streamed request for a prompt of ids and an output length, run to that length (each use adds its
# sampling): the served engine's ``_stream_body``.
Body = Callable[[list[int], int], dict[str, Any]]
WARMUP_TOKENS = 8  # a warm-up level's output: it only has to reach every batch size once


def bench_prompt_ids(vocab_size: int, length: int, count: int, seed: int | Sequence[int] = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` random ids below 10,000 (and the vocabulary), drawn as ``vllm bench``
    draws its dummy prompts (benchmarks/latency.py): the speed rule's and the load levels' prompts."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, min(vocab_size, 10000), length).tolist() for _ in range(count)]


def streamed(client: EndpointClient, body: dict[str, Any]) -> tuple[float, float, float, int]:
    """(start, first token, last token: perf_counter times; output tokens) of one streamed completion that
    ``body`` asks for ``max_tokens`` tokens of with ``ignore_eos``. Only a complete stream counts: one that
    ends with finish_reason "length" and, where the server reports token ids, with all ``max_tokens`` of
    them. A stream aborted early, carrying an error event or dropped raises EndpointError."""
    started = time.perf_counter()
    first = last = None
    tokens, ids_reported, finish = 0, False, None
    for at, event in client.stream("/v1/completions", body):
        for choice in event.get("choices") or []:
            ids = choice.get("token_ids")
            ids_reported = ids_reported or ids is not None
            count = len(ids) if ids is not None else (1 if choice.get("text") else 0)
            if count:
                first = first or at
                last = at
                tokens += count
            finish = choice.get("finish_reason") or finish
    asked = int(body["max_tokens"])
    if finish != "length" or (ids_reported and tokens != asked) or first is None or last is None:
        raise EndpointError(f"{client.shown}/v1/completions: a stream ended after {tokens} of {asked} tokens "
                            f"with finish_reason {finish!r} (a complete one ends with 'length')")
    return started, first, last, tokens


def _one(client: EndpointClient, body: dict[str, Any]) -> tuple[float, float, int]:
    """(TTFT, TPOT, output tokens) of one complete streamed request."""
    started, first, last, tokens = streamed(client, body)
    tpot = (last - first) / (tokens - 1) if tokens > 1 else float("nan")
    return first - started, tpot, tokens


def measure_level(client: EndpointClient, body: Body, concurrency: int, requests: int, input_len: int,
                  output_len: int, vocab_size: int, seed: int | Sequence[int] = 0) -> LoadLevel:
    """``requests`` streamed requests of random prompt ids (``body``: the server's request for a prompt and a
    length), ``concurrency`` in flight at a time.

    The same ``seed`` gives the same prompts, so a baseline and its candidate are sent alike; a
    second measurement of one server needs another seed, or its prefix cache serves the prompts.
    Only complete requests count: any failed one (an error status, an early end, an error event, a
    dropped stream) fails the level with the count; one past its deadline ends the level at once."""
    def attempt(prompt: list[int]) -> tuple[float, float, int] | EndpointError:
        try:
            return _one(client, {**body(prompt, output_len), "temperature": 0.0})
        except EndpointTimeout:
            raise
        except EndpointError as err:  # counted, and the level goes on
            return err

    started = time.perf_counter()
    outcomes = fan_out(client, bench_prompt_ids(vocab_size, input_len, requests, seed), attempt, concurrency)
    wall = time.perf_counter() - started
    failures = [outcome for outcome in outcomes if isinstance(outcome, EndpointError)]
    if failures:
        raise EndpointError(f"{client.shown}: load at concurrency {concurrency}: {len(failures)} of {requests} "
                            f"streamed requests failed (only complete requests count); the first: {failures[0]}")
    results = [outcome for outcome in outcomes if not isinstance(outcome, EndpointError)]
    return LoadLevel(concurrency, requests, wall, sum(r[2] for r in results),
                     tuple(r[0] for r in results), tuple(r[1] for r in results if r[2] > 1))


def measure_levels(client: EndpointClient, body: Body, spec: LoadSpec, vocab_size: int,
                   seed: int = 0) -> list[LoadLevel]:
    """Every level of ``spec``, after a short warm-up at the highest concurrency. Each level draws its
    prompts from its own seed (``seed`` and its concurrency), so no level's prompts are in the prefix
    cache from an earlier one; the same ``seed`` sends a baseline and its candidate the same prompts."""
    top = max(spec.concurrencies)
    measure_level(client, body, top, top, spec.input_len, WARMUP_TOKENS, vocab_size, seed=(seed, 0))
    return [measure_level(client, body, c, spec.requests_at(c), spec.input_len, spec.output_len, vocab_size,
                          seed=(seed, c)) for c in spec.concurrencies]
