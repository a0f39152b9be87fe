"""The documented way to gate a model with no published reference, on a trained model of another architecture.

A Qwen2 decoder (q/k/v biases, tied embeddings, grouped-query attention, none of which the embedded Llama has)
is trained here on CPU with the embedded byte tokenizer, on the Python documentation corpus and the second
half of the embedded corpus. It is then gated as docs/usage.md's "A model with no published reference" says:
limits as the default factors over its own Q8_0 round trip (`reference = "q8_0"`), the ideal E4M3 round trip
shown beside it, and as candidates its BF16 control and its Q8_0 round trip written by `fp8gate build` (both
must pass every rule), vLLM's online FP8, and the `noscale` plant (which must fail). Probabilities only: a
model trained for minutes answers no task. Prints pytest's summary and each verdict's table.

Run: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 .venv/bin/python benchmarks/other_architecture.py [--steps N]
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen2Config, Qwen2ForCausalLM

from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import toml_text

ENGLISH = Path(__file__).resolve().parent.parent / "pytest_fp8gate" / "assets" / "english" / "corpus.txt"
SEQ_LEN, BATCH, SEED = 256, 16, 7
GATED_CHUNKS, CHUNK_TOKENS = 2, 2000  # the first 4,000 tokens of the embedded corpus, as the demo scores them


def train(out: Path, steps: int) -> None:
    """A small Qwen2 trained to the end of a cosine schedule, saved in BF16 with the embedded tokenizer."""
    assets = embedded_assets()
    tokenizer = Tokenizer.from_file(str(assets.model / "tokenizer.json"))
    embedded = assets.corpus.read_text(encoding="utf-8")
    # Not the scored text: the gate's chunks come from the embedded corpus's start.
    text = ENGLISH.read_text(encoding="utf-8") + "\n" + embedded[len(embedded) // 2:]
    ids = torch.tensor(tokenizer.encode(text).ids, dtype=torch.long)
    config = Qwen2Config(vocab_size=tokenizer.get_vocab_size(), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=2048, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    torch.manual_seed(SEED)
    torch.set_num_threads(1)  # a small model: more threads only contend with the machine's other work
    model = Qwen2ForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    generator = torch.Generator().manual_seed(SEED)
    started = time.perf_counter()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 2e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(ids) - SEQ_LEN - 1, (BATCH,), generator=generator)
        batch = torch.stack([ids[s:s + SEQ_LEN] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(assets.model / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def fp8gate(*args: str) -> str:
    """The project's own command, as a user runs it; its printed path."""
    done = subprocess.run([str(Path(sys.executable).with_name("fp8gate")), *args], check=True,
                          capture_output=True, text=True)
    return done.stdout.strip()


def thresholds(model: Path, candidates: dict[str, dict[str, str]]) -> str:
    return toml_text({
        "device": "cpu",
        "deterministic_scheduling": True,
        "baseline": {"name": "bf16", "model": model.as_posix(),
                     "engine": {"dtype": "bfloat16", "max_model_len": 2048, "enforce_eager": True,
                                "kv_cache_memory_bytes": 1 << 30}},
        "noise": {"passes": ["batch-order", "fp32"]},
        "probabilities": {"corpus": embedded_assets().corpus.as_posix(), "chunks": GATED_CHUNKS,
                          "chunk_tokens": CHUNK_TOKENS, "full_vocab": True, "references": ["e4m3"],
                          "limits": {"reference": "q8_0"}},
        "candidates": [{"name": name, **keys} for name, keys in candidates.items()],
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--workdir", type=Path, default=Path("fp8gate-other-architecture"))
    args = parser.parse_args()
    work = args.workdir.resolve()
    model = work / "qwen2"
    if not (model / "model.safetensors").is_file():
        train(model, args.steps)
    candidates = {
        "control": {"model": fp8gate("build", "bf16-rerounded", str(model), str(work / "control"))},
        "q8_0-roundtrip": {"model": fp8gate("build", "q8_0", str(model), str(work / "q8_0"))},
        "fp8-per-channel": {"quantization": "fp8_per_channel"},
        "planted-noscale": {"model": str(work / "noscale")},
    }
    from pytest_fp8gate.tools.demo.planting import plant

    plant("noscale", model, work / "noscale")
    path = work / "thresholds.toml"
    path.write_text(thresholds(model, candidates), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "pytest", str(path), "--rootdir", str(work), "-p", "no:randomly",
                           "-p", "no:cacheprovider", "--fp8gate-artifacts", str(work / "artifacts"), "-rfEs"],
                          capture_output=True, text=True, cwd=work)
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if "fp8gate summary" in line), 0)
    print("\n".join(lines[start:]))
    print(f"pytest exit {done.returncode}")


if __name__ == "__main__":
    main()
