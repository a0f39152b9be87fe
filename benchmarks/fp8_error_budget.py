"""Where FP8's distance from BF16 comes from on the embedded model, emulated in torch.

Run: .venv/bin/python benchmarks/fp8_error_budget.py [--model DIR] [--keep 0,2,4,8,16]

vLLM's online ``fp8_per_channel`` rounds every q/k/v/o/gate/up/down weight to E4M3 with
one scale per output row, and each such layer's input to E4M3 with one scale per token
(W8A8; lm_head, embeddings and norms stay BF16). This script redoes that rounding in torch
on the demo's corpus chunks and prints the mean KL over the whole vocabulary against the
BF16 weights computed in fp32, for:

- BF16 and FP16 compute (no FP8): the rounding the gate's noise floor is made of;
- W8A8 on every layer (vLLM's recipe), its weight rounding alone, its input rounding alone;
- one layer at a time in W8A8, summed by block and by projection;
- W8A8 with the k layers that cost most kept in BF16 (an ignore list, as llm-compressor writes).

It answers two questions the gate's verdict raises: is FP8's distance the format's, spread
over every layer, or one layer's that an ignore list would remove; and how far above BF16's
own rounding it sits. An emulation, not the engine: the gate's figures come from vLLM.
Figures, not verdicts.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.run.corpus import load_text
from pytest_fp8gate.tools.demo.fp8_emulation import PROJECTION, Fp8Emulation
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG


def corpus_chunks(model_dir: Path, text: str, chunks: int, chunk_tokens: int) -> list[torch.Tensor]:
    """The demo's chunks: BOS then chunk_tokens - 1 corpus tokens each, as the gate cuts them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    body = chunk_tokens - 1
    return [torch.tensor([[tokenizer.bos_token_id, *ids[i * body:(i + 1) * body]]]) for i in range(chunks)]


@torch.no_grad()
def log_probs(model: torch.nn.Module, chunks: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([torch.log_softmax(model(chunk).logits[0].float(), -1) for chunk in chunks])


def mean_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the demo's baseline model")
    parser.add_argument("--keep", default="0,2,4,8,16", help="layer counts to keep in BF16, most costly first")
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = load_config(DEMO_CONFIG)
    assert config.probabilities is not None
    model_dir = args.model or Path(config.baseline.model)
    spec = config.probabilities
    chunks = corpus_chunks(model_dir, load_text(spec.corpus), spec.chunks, spec.chunk_tokens)
    started = time.time()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    reference = log_probs(model, chunks)
    positions = reference.shape[0]
    print(f"{model_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters; {positions} positions "
          f"({len(chunks)} corpus chunks as the demo cuts them); mean KL over the whole vocabulary against the "
          f"BF16 weights computed in fp32")

    rows: list[tuple[str, float]] = []
    for dtype in (torch.bfloat16, torch.float16):
        low = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        label = f"{str(dtype).removeprefix('torch.')} compute, no FP8"
        rows.append((label, mean_kl(reference, log_probs(low, chunks))))
        del low
    floor = rows[0][1]
    emulation = Fp8Emulation(model)
    every = list(emulation.layers)
    for label, weights, inputs in (("W8A8, every layer (vLLM fp8_per_channel)", True, True),
                                   ("weights only (W8A16)", True, False), ("inputs only", False, True)):
        emulation.apply(every, weights=weights, inputs=inputs)
        rows.append((label, mean_kl(reference, log_probs(model, chunks))))
    print("\nTable 1. Whole model")
    for label, kl in rows:
        print(f"  {label:<44} KL {kl:.3e}  {kl / floor:6.2f} x BF16 compute")

    single = {}
    for name in every:
        emulation.apply([name])
        single[name] = mean_kl(reference, log_probs(model, chunks))
    total = sum(single.values())
    ranked = sorted(single, key=single.get, reverse=True)
    by_block: dict[str, float] = defaultdict(float)
    by_projection: dict[str, float] = defaultdict(float)
    for name, kl in single.items():
        by_block[name.split(".")[2]] += kl
        by_projection[name.rsplit(".", 1)[-1]] += kl
    print(f"\nTable 2. One layer at a time in W8A8 ({len(every)} layers; shares of the sum of single-layer KLs, "
          f"{total:.3e})")
    for name in ranked[:8]:
        print(f"  {name:<36} KL {single[name]:.3e}  {single[name] / total:6.1%}")
    print("  by block:      " + ", ".join(f"{block} {kl / total:.0%}" for block, kl in sorted(by_block.items())))
    print("  by projection: " + ", ".join(f"{proj.removesuffix('_proj')} {by_projection[proj] / total:.0%}"
                                         for proj in PROJECTION))

    print("\nTable 3. W8A8 with the k costliest layers (Table 2's order) kept in BF16")
    for keep in (int(k) for k in args.keep.split(",")):
        emulation.apply(ranked[keep:])
        kl = mean_kl(reference, log_probs(model, chunks))
        print(f"  keep {keep:>2} of {len(every)} in BF16: KL {kl:.3e}  {kl / floor:6.2f} x BF16 compute")
    print(f"\n({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
