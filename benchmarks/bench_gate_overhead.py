"""The demo gate's wall time next to a bare vLLM script doing the same engine work.

Runs, one after the other in this process's machine:
  1. `fp8gate demo` (BF16 vs online fp8_per_channel, noise passes batch-order and fp16);
  2. a bare script with the same engine starts, the same corpus chunks, the same
     task prompts (read back from the gate's exported lm-eval samples) and the
     same greedy generations, with no pytest, lm-eval or statistics around it.
Prints both wall times and the gate's overhead. Usage:
  python benchmarks/bench_gate_overhead.py [WORKDIR]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


def bare(workdir: Path) -> None:
    """The engine work of the demo, straight on vllm.LLM."""
    import gc

    import tomllib

    config = tomllib.loads((workdir / "thresholds.toml").read_text())
    if config.get("deterministic_scheduling"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine cores in this process, as the gate runs them

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from pytest_fp8gate.engines.base import ALL_AT_ONCE
    from pytest_fp8gate.run.measure import BATCH_ORDER

    probs, task = config["probabilities"], config["tasks"][0]
    samples = workdir / "artifacts" / "bf16" / "main" / f"samples_{task['name']}.jsonl"
    contexts = [json.loads(line)["arguments"] for line in samples.read_text().splitlines()]
    contexts = [args[0][0] if isinstance(args[0], list) else args["gen_args_0"]["arg_0"]
                for args in contexts][: len(contexts) // 2]  # one row per filter: keep the first filter's
    text = Path(probs["corpus"]).read_text()
    engine = dict(config["baseline"]["engine"], model=config["baseline"]["model"], max_logprobs=-1)
    runs = [("bf16", engine, True), ("bf16-fp16", dict(engine, dtype="float16"), False),
            ("fp8", dict(engine, quantization=config["candidates"][0]["quantization"]), False)]
    for name, kwargs, with_noise_pass in runs:
        llm = LLM(**kwargs)
        tok = llm.get_tokenizer()
        ids = tok.encode(text, add_special_tokens=False)
        body = probs["chunk_tokens"] - 1
        chunks = [[tok.bos_token_id] + ids[i * body:(i + 1) * body] for i in range(probs["chunks"])]
        prompts = [{"prompt_token_ids": [tok.bos_token_id] + tok.encode(c, add_special_tokens=False)}
                   for c in contexts]
        score = SamplingParams(max_tokens=1, prompt_logprobs=-1, flat_logprobs=True, detokenize=False)
        greedy = SamplingParams(temperature=0.0, max_tokens=128, stop=["Question:", "</s>", "<|im_end|>"])
        # The main pass, then the batch-order noise pass in the gate's own request order.
        for layout in [ALL_AT_ONCE] + ([BATCH_ORDER] if with_noise_pass else []):
            for items, params in (([{"prompt_token_ids": c} for c in chunks], score), (prompts, greedy)):
                for batch in layout.batches(len(items)):
                    llm.generate([items[i] for i in batch], params, use_tqdm=False)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def timed(command: list[str]) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=False, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fp8gate-bench-"))
    gate_s = timed([sys.executable, "-m", "pytest_fp8gate.tools.cli", "demo", "--workdir", str(workdir)])
    bare_s = timed([sys.executable, __file__, "--bare", str(workdir)])
    print(f"demo gate (pytest + lm-eval + statistics) : {gate_s:8.1f} s")
    print(f"bare vLLM script, same engine work        : {bare_s:8.1f} s")
    print(f"gate overhead                             : {100 * (gate_s / bare_s - 1):+8.1f} %")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--bare":
        bare(Path(sys.argv[2]))
    else:
        main()
