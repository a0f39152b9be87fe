"""The load rule's null: one served model measured several times at each level, and each round's output
tok/s as a fraction of the first round's. A candidate no slower than its baseline lands within this
spread, so ``[load] min_throughput_fraction`` must sit below it (docs/why-defaults.md, "The basis of
min_throughput_fraction").

One ``vllm serve`` of the model, every round on it (each round its own prompts, so the prefix cache
serves none of them twice). On CPU, under the engine lock:

    flock /tmp/fp8gate-engine.lock python benchmarks/load_null.py --concurrencies 1,4 --rounds 5

``gpu_check.py --parts served`` calls ``null_rounds`` for the 8B shape on the H200.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Sequence
from pathlib import Path

from pytest_fp8gate import checkpoint
from pytest_fp8gate.config.spec import LoadSpec
from pytest_fp8gate.core.rules import LoadLevel, throughput_fractions
from pytest_fp8gate.engines import load, vllm_api
from pytest_fp8gate.engines.http_client import EndpointClient
from pytest_fp8gate.engines.server_process import ManagedServer
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes

CPU_FLAGS = f"--dtype bfloat16 --max-model-len 2048 --enforce-eager --kv-cache-memory-bytes {cpu_kv_cache_bytes()}"


def null_rounds(argv: Sequence[str], served_name: str, spec: LoadSpec, rounds: int, vocab_size: int,
                health_timeout_s: float = 1200) -> list[list[LoadLevel]]:
    """``rounds`` measurements of every level of ``spec`` on one server started from ``argv``."""
    server = ManagedServer("load-null", list(argv), max_logprobs=1)
    try:
        server.wait_healthy(health_timeout_s)
        client = EndpointClient(server.url)
        body = functools.partial(vllm_api.stream_body, served_name)
        return [load.measure_levels(client, body, spec, vocab_size, seed=1000 + r) for r in range(rounds)]
    finally:
        server.finish()


def null_lines(found: list[list[LoadLevel]]) -> list[str]:
    """Each round's levels, every later round's fraction of the first's, and the worst pair per level."""
    lines = []
    for r, levels in enumerate(found):
        for level in levels:
            d = level.as_dict()
            lines.append(f"    round {r} c={d['concurrency']:<3} {d['requests']:>4} requests {d['output_tok_s']:9.1f} "
                         f"output tok/s  TTFT p50 {d['ttft_p50_s'] * 1e3:8.1f} ms p99 {d['ttft_p99_s'] * 1e3:8.1f} ms"
                         f"  TPOT p50 {d['tpot_p50_s'] * 1e3:7.2f} ms p99 {d['tpot_p99_s'] * 1e3:7.2f} ms")
    pairs = [throughput_fractions(levels, found[0]) for levels in found[1:]]
    for r, fractions in enumerate(pairs, start=1):
        lines.append(f"    null fraction round {r} / round 0: "
                     + ", ".join(f"c={c}: {f:.3f}" for c, f in fractions.items()))
    if pairs:
        # Under the null either model may be measured in either round: the worst pair is the slowest
        # round over the fastest, the lowest fraction a candidate as fast as its baseline can draw.
        tok_s = {level.concurrency: [levels[i].output_tok_s for levels in found]
                 for i, level in enumerate(found[0])}
        lines.append("    null worst pair (slowest round / fastest round): " + ", ".join(
            f"c={c}: {min(v) / max(v):.3f}" for c, v in tok_s.items()))
    return lines


def main() -> int:
    from pytest_fp8gate.tools.demo.embedded import embedded_assets

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo's embedded model")
    parser.add_argument("--flags", default=CPU_FLAGS, help="vllm serve flags")
    parser.add_argument("--concurrencies", default="1,4")
    parser.add_argument("--requests", type=int, default=None, help="per level (default: [load]'s)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = str(args.model or embedded_assets().model)
    spec = LoadSpec(concurrencies=tuple(int(c) for c in args.concurrencies.split(",") if c), requests=args.requests,
                    input_len=args.input_len, output_len=args.output_len)
    started = time.perf_counter()
    found = null_rounds(["serve", model, *args.flags.split()], model, spec, args.rounds,
                        checkpoint.vocab_size_hint(model))
    print(f"load null, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: vllm serve {model} {args.flags}; "
          f"{args.rounds} rounds at c={args.concurrencies}, {args.input_len} in, {args.output_len} out, requests "
          f"{[spec.requests_at(c) for c in spec.concurrencies]}; {time.perf_counter() - started:.0f} s")
    print("\n".join(null_lines(found)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
