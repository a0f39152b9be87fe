"""How the evicted-sink plant answers the demo's task under one vLLM engine setting.

The plant (pytest_fp8gate/tools/demo/sink_plant.py) is the baseline to the bit while BOS is inside its
2,000-token window, and the task's prompts are about 1,000 tokens long: its answers should be the
baseline's. This runs one model under one setting and writes its answers, so that settings can be
set side by side (each run is its own process: one engine per process).

Run: python benchmarks/sink_engine_settings.py MODEL SETTING OUT.json [--questions N]
     python benchmarks/sink_engine_settings.py --compare BASELINE.json OTHER.json ...
SETTING: default, no-prefix-caching, no-cascade, eager.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from plant_kl import STOPS, strict_answer, task_prompts

SETTINGS: dict[str, dict[str, object]] = {
    "default": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "no-cascade": {"disable_cascade_attn": True},
    "eager": {"enforce_eager": True},
}


def answer(model: str, setting: str, questions: int) -> dict[str, object]:
    from vllm import LLM, SamplingParams

    prompts, golds = task_prompts(questions)
    started = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", max_model_len=2048, gpu_memory_utilization=0.3, seed=0,
              **SETTINGS[setting])
    tokenizer = llm.get_tokenizer()
    ids = [[tokenizer.bos_token_id, *tokenizer.encode(p, add_special_tokens=False)] for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=256, stop=STOPS)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
    texts = [o.outputs[0].text for o in outputs]
    answers = [strict_answer(text) for text in texts]
    return {"model": model, "setting": setting, "seconds": round(time.perf_counter() - started, 1),
            "accuracy": sum(a == g for a, g in zip(answers, golds)) / len(golds), "texts": texts}


def compare(paths: list[Path]) -> None:
    runs = [json.loads(p.read_text()) for p in paths]
    base = runs[0]
    for run in runs:
        same = sum(a == b for a, b in zip(run["texts"], base["texts"]))
        print(f"{Path(run['model']).name:>14} {run['setting']:>18}: accuracy {run['accuracy']:.3f}, "
              f"{same} of {len(base['texts'])} answers the first run's text exactly, {run['seconds']} s")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", nargs="+", type=Path)
    parser.add_argument("model", nargs="?")
    parser.add_argument("setting", nargs="?", choices=sorted(SETTINGS))
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--questions", type=int, default=100)
    args = parser.parse_args(argv)
    if args.compare:
        compare(args.compare)
        return 0
    if not (args.model and args.setting and args.out):
        parser.error("MODEL, SETTING and OUT are required without --compare")
    args.out.write_text(json.dumps(answer(args.model, args.setting, args.questions)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
