"""Train the embedded tiny Llama (deterministic: fixed seeds, fixed data).

Usage: python training/train.py OUT_DIR [--max-minutes M]

Builds a byte-level tokenizer (BOS/EOS, no merges, so digits stay single
tokens), a LlamaForCausalLM, trains it on the text from make_data.py, and
keeps the checkpoint whose 5-shot greedy accuracy on the validation split is
closest to the middle of the 40-90% band, so answers can flip both ways.
OUT_DIR receives model/ (BF16 safetensors, configs, tokenizer), tasks/,
corpus.txt and training_log.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import make_data

SEED = 1234
SEQ_LEN = 2048
BATCH = 32
TARGET_ACCURACY = 0.65
BAND = (0.45, 0.85)
SPECIALS = ["<pad>", "<s>", "</s>"]
ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")


def build_tokenizer() -> PreTrainedTokenizerFast:
    byte_symbols = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for symbol in sorted(byte_symbols):
        vocab[symbol] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    core.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        clean_up_tokenization_spaces=False, model_max_length=SEQ_LEN)


def model_config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=SEQ_LEN, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        torch_dtype="bfloat16")


def encode_corpus(tokenizer: PreTrainedTokenizerFast, text: str) -> np.ndarray:
    """Byte-level without merges: one token per byte, so a lookup table is exact."""
    table = np.zeros(128, dtype=np.int64)
    for b in range(1, 128):
        table[b] = tokenizer(chr(b), add_special_tokens=False).input_ids[0]
    docs = text.split("\x00")
    pieces = []
    for doc in docs:
        raw = np.frombuffer(doc.encode("utf-8"), dtype=np.uint8)
        pieces.append(np.concatenate([[1], table[raw], [2]]))
    ids = np.concatenate(pieces)
    sample = docs[0][:500]
    assert list(ids[1:1 + len(sample)]) == tokenizer(sample, add_special_tokens=False).input_ids
    return ids


@torch.no_grad()
def accuracy(model, tokenizer, rows: list[dict], shots: list[dict], device: str) -> float:
    """5-shot greedy accuracy with lm-eval's gsm8k layout and strict-match scoring."""
    model.eval()
    prefix = make_data.few_shot_block(shots) + "\n\n"
    prompts = [prefix + f"Question: {r['question']}\nAnswer:" for r in rows]
    tokenizer.padding_side = "left"
    correct = 0
    for start in range(0, len(prompts), 100):
        batch = tokenizer(prompts[start:start + 100], return_tensors="pt", padding=True).to(device)
        out = model.generate(**batch, max_new_tokens=96, do_sample=False, pad_token_id=0, eos_token_id=2)
        texts = tokenizer.batch_decode(out[:, batch.input_ids.shape[1]:], skip_special_tokens=True)
        for text, row in zip(texts, rows[start:start + 100]):
            got = ANSWER.search(text.split("Question:")[0])
            want = row["answer"].split("#### ")[-1]
            correct += bool(got) and got.group(1) == want
    model.train()
    return correct / len(rows)


def finalize_model_dir(model_dir: Path) -> None:
    """Make the saved files load the same way under transformers 4.x and 5.x and in vLLM."""
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"  # the weights are stored in BF16; "auto" must load them as such
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    tok_path = model_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text())
    tok_config.pop("backend", None)
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_path.write_text(json.dumps(tok_config, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--max-minutes", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=6000)
    parser.add_argument("--eval-every", type=int, default=250)
    args = parser.parse_args()
    out = Path(args.out_dir)
    data_dir = out / "data"
    make_data.main(str(data_dir))

    torch.manual_seed(SEED)
    np.random.seed(SEED)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = build_tokenizer()
    ids = torch.from_numpy(encode_corpus(tokenizer, (data_dir / "train.txt").read_text()))
    valid = [json.loads(l) for l in (data_dir / "valid.jsonl").read_text().splitlines()]
    shots = [json.loads(l) for l in (data_dir / "tasks" / "fewshot.jsonl").read_text().splitlines()][:5]

    model = LlamaForCausalLM(model_config(len(tokenizer))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = 200
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    generator = torch.Generator().manual_seed(SEED)
    n_windows = (len(ids) - 1) // SEQ_LEN
    log: list[dict] = []
    best: tuple[float, int] | None = None
    started = time.time()
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, n_windows, (BATCH,), generator=generator) * SEQ_LEN
        batch = torch.stack([ids[s:s + SEQ_LEN + 1] for s in starts]).to(device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        out_of_time = time.time() - started > args.max_minutes * 60
        if step % args.eval_every == 0 or step == args.steps or out_of_time:
            acc = accuracy(model, tokenizer, valid, shots, device)
            log.append({"step": step, "loss": round(loss.item(), 4), "valid_accuracy": acc,
                        "seconds": round(time.time() - started, 1)})
            print(json.dumps(log[-1]), flush=True)
            in_band = BAND[0] <= acc <= BAND[1]
            if in_band and (best is None or abs(acc - TARGET_ACCURACY) < best[0]):
                best = (abs(acc - TARGET_ACCURACY), step)
                weights = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
                model.save_pretrained(out / "model", state_dict=weights, safe_serialization=True)
        if out_of_time:
            break
    if best is None:
        raise SystemExit("no checkpoint reached the 40-90% band; see the log above")
    tokenizer.save_pretrained(out / "model")
    finalize_model_dir(out / "model")
    shutil.copytree(data_dir / "tasks", out / "tasks", dirs_exist_ok=True)
    shutil.copy(data_dir / "corpus.txt", out / "corpus.txt")
    (out / "training_log.json").write_text(json.dumps({
        "selected_step": best[1], "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__, "seconds": round(time.time() - started, 1), "log": log}, indent=1))


if __name__ == "__main__":
    main()
