"""Does a fresh engine instance add noise that a re-run inside the baseline's engine does not?

Run: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python benchmarks/engine_instance.py
       [--model tiny|smollm2] [--questions N] [--cuda] [--fresh N]

The gate's noise floor re-runs BF16 inside the baseline's engine, its prefix cache warm, while every
candidate runs in an engine of its own. Whatever two engine instances do differently (memory
allocation, batch shapes, compiled graphs) would then be charged to the candidate and not to the
floor. This script measures it on identical weights, with the demo's thresholds and engine
settings (CUDA graphs where the demo uses them): the baseline's first pass against

- the same engine, the same request order (an exact re-run);
- the same engine in the gate's batch order (the floor's pass);
- N fresh engines of the same checkpoint, the main request order.

Each row gives the probability figures and the flips of the demo's task, as the gate computes them.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
from validity import Measured, by_chunk, count_flips, run_engine

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import GateConfig
from pytest_fp8gate.engines.base import ALL_AT_ONCE
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run.lm_tasks import task_manager
from pytest_fp8gate.run.measure import BATCH_ORDER
from pytest_fp8gate.tools.demo.run import DEMO_MODELS, demo_config, toml_text


def demo_thresholds(model: str, scratch: Path, cuda: bool) -> GateConfig:
    """The thresholds ``fp8gate demo [--model smollm2] [--cuda]`` writes, its engine settings untouched."""
    source = None
    if model == "smollm2":
        from pytest_fp8gate.tools.demo.smollm2 import smollm2_checkpoint

        source = smollm2_checkpoint()
    path = scratch / "thresholds.toml"
    path.write_text(toml_text(demo_config({}, cuda=cuda, model=source)), encoding="utf-8")
    return load_config(path)


def row(label: str, base: Measured, other: Measured, config: GateConfig) -> str:
    comparison = by_chunk(base.run, other.run, config)
    identical = bool(np.array_equal(base.run.real_logprob, other.run.real_logprob))
    largest = float(np.max(np.abs(base.run.real_logprob - other.run.real_logprob)))
    kl = "-" if comparison.mean_kl is None else f"{comparison.mean_kl:.3g} ± {comparison.kl_se:.2g}"
    return (f"{label:<34} {kl:>20} {comparison.same_top:>9.4%} {comparison.rms_dp:>8.4%} "
            f"{comparison.ppl_ratio:>9.6f} {count_flips(base, other):>3}/{len(base.answers):<4} "
            f"{'yes' if identical else 'no':>9} {largest:>10.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=DEMO_MODELS, default="tiny")
    parser.add_argument("--questions", type=int, help="task questions (default: the demo's)")
    parser.add_argument("--cuda", action="store_true", help="the demo's --cuda settings")
    parser.add_argument("--fresh", type=int, default=2, help="fresh engines of the same checkpoint")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        scratch = Path(temp)
        config = demo_thresholds(args.model, scratch, args.cuda)
        config = replace(config, tasks=[replace(config.tasks[0], limit=args.questions or config.tasks[0].limit)])
        VllmEngine.prepare_process(config.deterministic_scheduling)
        manager = task_manager(config.tasks)
        first = run_engine(config.baseline, config, manager, {"rerun": ALL_AT_ONCE, "batch-order": BATCH_ORDER},
                           scratch)
        fresh = [run_engine(replace(config.baseline, name=f"fresh-{i}"), config, manager, {}, scratch)["main"]
                 for i in range(1, args.fresh + 1)]
    base = first["main"]
    assert config.probabilities is not None
    print(f"{args.model} on {'CUDA' if args.cuda else 'CPU'}: {config.probabilities.chunks} x "
          f"{config.probabilities.chunk_tokens} positions, {len(base.answers)} questions of "
          f"{config.tasks[0].name}; the baseline's first pass against:")
    print(f"{'':<34} {'mean KL ± SE':>20} {'same top':>9} {'RMS dp':>8} {'PPL ratio':>9} {'flips':>8} "
          f"{'identical':>9} {'max |dlogp|':>10}")
    print(row("same engine, same order (re-run)", base, first["rerun"], config))
    print(row("same engine, batch order (floor)", base, first["batch-order"], config))
    for i, measured in enumerate(fresh, 1):
        print(row(f"fresh engine {i}, same order", base, measured, config))
    if len(fresh) > 1:
        print(row("fresh engine 2 against fresh engine 1", fresh[0], fresh[1], config))


if __name__ == "__main__":
    main()
