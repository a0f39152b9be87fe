"""The article's whole scenario on one GPU, timed by the gate's own table (issue 33).

Run on a CUDA machine (the lent H200 through ../shared/gpu's kit; CI never has a GPU):

    python benchmarks/article_scenario.py --form in-process --cache cold
    python benchmarks/article_scenario.py --form in-process --cache warm
    python benchmarks/article_scenario.py --form served --cache warm

The scenario: a Llama-3.1-8B-shaped checkpoint with random BF16 weights (written once under
``--workdir``, not timed with the gate), the batch-order noise pass, online fp8_per_channel and the
project's FP8-dynamic checkpoint as candidates (the served form serves BF16 and fp8_per_channel
with ``vllm serve`` and adds [load] at 1, 8 and 64), 100 corpus chunks of 2,048 tokens at top 20,
500 five-shot questions of 256 new tokens, and the speed rule. ``--cache cold`` empties the
baseline cache and vLLM's compile cache first; ``warm`` keeps what the last run left.

It prints pytest's wall time, every rule's outcome and the gate's "fp8gate time:" lines.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import gpu_check

from pytest_fp8gate.tools.demo.embedded import embedded_assets

TASK = """[[tasks]]
name = "arith"
task = "fp8gate_tiny_arith"
include_path = "{tasks}"
num_fewshot = 5
limit = {questions}
max_gen_toks = 256
filter = "strict-match"
metric = "exact_match"
add_bos_token = true
[tasks.limits]
accuracy_se = 1.0
flips_ratio = 2.0
flip_rule = "binomial"
min_flip_allowance = 0.01
"""


def scenario_config(args: argparse.Namespace, workdir: Path, bf16: Path, fp8: Path) -> Path:
    """The shape check's config (gpu_check) with the scenario's task table before the candidates."""
    shape = argparse.Namespace(chunks=100, chunk_tokens=2048, input_len=1000, output_len=256, iters=10,
                               gpu_memory_utilization=args.gpu_memory_utilization, device="cuda",
                               candidates="fp8-per-channel,fp8-dynamic", concurrencies="1,8,64")
    if args.form == "served":
        config, models = gpu_check.served_config(shape, workdir, bf16)
        flags = models["bf16"].split(" ", 2)[2]  # the same flags for every server
        with config.open("a", encoding="utf-8") as out:
            out.write(f'[[candidates]]\nname = "fp8-dynamic"\nserve = "vllm serve {fp8} {flags}"\n')
    else:
        config = gpu_check.shape_config(shape, workdir, bf16, fp8)
    text = config.read_text(encoding="utf-8")
    task = TASK.format(tasks=embedded_assets().tasks, questions=args.questions)
    cut = text.index("[[candidates]]")
    config.write_text(text[:cut] + task + text[cut:], encoding="utf-8")
    return config


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/root/article-scenario"))
    parser.add_argument("--form", choices=("in-process", "served"), default="in-process")
    parser.add_argument("--cache", choices=("cold", "warm"), default="cold")
    parser.add_argument("--questions", type=int, default=500)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--prepare-only", action="store_true", help="Write the checkpoints and stop")
    args = parser.parse_args()

    from pytest_fp8gate.tools.fp8_writer import MARKER as QUANTIZED_MARKER
    from pytest_fp8gate.tools.fp8_writer import write_fp8_checkpoint
    from pytest_fp8gate.tools.shapes import MARKER as RANDOM_MARKER
    from pytest_fp8gate.tools.shapes import write_random_checkpoint

    bf16, fp8 = args.workdir / "bf16", args.workdir / "fp8-dynamic"
    started = time.perf_counter()
    if not (bf16 / RANDOM_MARKER).is_file():
        write_random_checkpoint("llama-3.1-8b", bf16, device="cuda")
    if not (fp8 / QUANTIZED_MARKER).is_file():
        write_fp8_checkpoint(bf16, fp8, "fp8-dynamic", device="cuda")
    print(f"checkpoints ready in {time.perf_counter() - started:.0f} s (not part of the gate's time)", flush=True)
    if args.prepare_only:
        return 0

    caches = {"baseline": args.workdir / "baseline-cache", "compile": args.workdir / "compile-cache"}
    for path in caches.values():
        if args.cache == "cold":
            shutil.rmtree(path, ignore_errors=True)
        path.mkdir(parents=True, exist_ok=True)
    workdir = args.workdir / f"{args.form}-{args.cache}"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    config = scenario_config(args, workdir, bf16, fp8)
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest", str(config), "--fp8gate-config", str(config), "--rootdir",
               str(workdir), "--fp8gate-artifacts", str(workdir / "artifacts"), "-p", "no:cacheprovider",
               "-p", "no:randomly", "-rfEs", "--json-report", f"--json-report-file={report}",
               "--fp8gate-baseline-cache", str(caches["baseline"]),
               "--fp8gate-compile-cache", str(caches["compile"])]
    code, seconds = gpu_check.run_logged(command, workdir / "gate.log", 3600)
    print(f"{args.form}, {args.cache} caches: pytest exit {code} in {seconds:.0f} s ({gpu_check.versions()})")
    print("\n".join(gpu_check.rule_table(report)))
    log = (workdir / "gate.log").read_text(encoding="utf-8", errors="replace").splitlines()
    print("\n".join(line for line in log if line.startswith(("fp8gate time:", "fp8gate: "))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
