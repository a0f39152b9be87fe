"""A small PEFT LoRA adapter for a Llama-shaped checkpoint, written as PEFT writes one
(``adapter_config.json`` and ``adapter_model.safetensors``) on every layer's q_proj and v_proj.
The demo gates it on its base (``fp8gate demo --lora``); its weights are random, so it changes
the model's answers by a fixed amount that the BF16 and FP8 bases should carry alike."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save

from ...atomic import atomic_write_bytes, atomic_write_text

ADAPTER_MODULES = ("q_proj", "v_proj")


def write_adapter(directory: Path, model: Path, rank: int = 4, scale: float = 0.05, seed: int = 0) -> Path:
    """Write the adapter for the checkpoint at ``model`` (its config.json gives the shapes) into ``directory``."""
    shape = json.loads((model / "config.json").read_text(encoding="utf-8"))
    hidden, heads = shape["hidden_size"], shape["num_attention_heads"]
    head_dim = shape.get("head_dim") or hidden // heads
    outputs = {"q_proj": heads * head_dim, "v_proj": shape.get("num_key_value_heads", heads) * head_dim}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for module in ADAPTER_MODULES:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, hidden, generator=generator) * scale).bfloat16()
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(outputs[module], rank, generator=generator)
                                                  * scale).bfloat16()
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(directory / "adapter_model.safetensors", save(tensors))
    atomic_write_text(directory / "adapter_config.json", json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(ADAPTER_MODULES), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": False, "modules_to_save": None}))
    return directory
