"""Write a pre-quantized FP8 checkpoint (compressed-tensors format) from a BF16 one.

The layouts are those of RedHat's published Llama checkpoints, which vLLM loads
as ``CompressedTensorsW8A8Fp8`` with ``quantization`` left unset:

- ``fp8-dynamic``: E4M3 weights with one scale per output row, activations
  quantized per token at run time (``...-FP8-dynamic``);
- ``fp8-static``: E4M3 weights with one scale per matrix, and one static
  activation scale per linear layer calibrated on text (``...-FP8``).

Every 2-D weight of the decoder layers is quantized; the embeddings, the
lm_head and the norms stay in the checkpoint's dtype, so the roofline of the
result reads like the article's (8.0 GB a token for Llama 3.1 8B).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..atomic import atomic_directory
from ..checkpoint import check_model_dir, safetensors_files
from ..errors import CheckpointError, QuantizeError

E4M3_MAX = 448.0
MARKER = ".fp8gate-quantized"  # written last: a directory without it is unfinished


@dataclass(frozen=True)
class Scheme:
    name: str
    weight_strategy: str  # "channel" or "tensor"
    dynamic_activations: bool
    description: str


SCHEMES = {
    "fp8-dynamic": Scheme("fp8-dynamic", "channel", True,
                          "per-channel E4M3 weights, dynamic per-token activations"),
    "fp8-static": Scheme("fp8-static", "tensor", False,
                         "per-tensor E4M3 weights, static per-tensor activation scales from calibration"),
}
# An MoE router ("mlp.gate", beside the experts' gate_proj) stays BF16, as vLLM builds it and as
# llm-compressor's FP8 recipes for Qwen3-MoE leave it: its scores pick the experts.
_NOT_QUANTIZED = ("embed_tokens", "lm_head", "gate")
ROUTER_PATTERN = "re:.*mlp[.]gate$"
CALIBRATION_PIECES = 16
CALIBRATION_CHARS = 4096  # a piece is cut to 2,048 tokens anyway (activation_scales)


def calibration_pieces(text: str) -> list[str]:
    """The first CALIBRATION_PIECES pieces of CALIBRATION_CHARS characters of ``text``."""
    return [text[i:i + CALIBRATION_CHARS] for i in range(0, len(text), CALIBRATION_CHARS)][:CALIBRATION_PIECES]


def quantization_config(scheme: Scheme, *, has_router: bool = False) -> dict[str, Any]:
    """The compressed-tensors ``quantization_config`` block for config.json (an MoE model's
    routers listed as left unquantized)."""
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": scheme.dynamic_activations,
                   "strategy": "token" if scheme.dynamic_activations else "tensor",
                   "observer": None if scheme.dynamic_activations else "minmax"}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
               "strategy": scheme.weight_strategy, "observer": "minmax"}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                      "input_activations": activations, "output_activations": None}},
        "ignore": ["lm_head", ROUTER_PATTERN] if has_router else ["lm_head"],
        "kv_cache_scheme": None,
    }


def is_quantized_weight(name: str, shape: tuple[int, ...]) -> bool:
    """A decoder linear layer's matrix: 2-D, not an embedding, the lm_head or an MoE router."""
    module = name.rpartition(".")[0]
    return name.endswith(".weight") and len(shape) == 2 and module.rpartition(".")[2] not in _NOT_QUANTIZED


def quantize_weight(weight: Any, strategy: str) -> tuple[Any, Any]:
    """(E4M3 weight, float32 scale) with the largest magnitude of each row (channel) or
    of the matrix (tensor) mapped to 448; scale shapes [out, 1] and [1]."""
    import torch

    magnitude = weight.abs().float()
    amax = magnitude.amax(dim=1, keepdim=True) if strategy == "channel" else magnitude.amax().reshape(1)
    scale = (amax / E4M3_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    divisor = scale if strategy == "channel" else scale.reshape(1, 1)
    quantized = (weight.float() / divisor).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized, scale


def activation_scales(model_dir: Path, texts: Iterable[str], device: str, max_tokens: int = 2048) -> dict[str, float]:
    """Per quantized linear layer, max |input| / 448 over the calibration texts (transformers forward)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    amax: dict[str, float] = {}
    hooks = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_quantized_weight(f"{name}.weight", tuple(module.weight.shape)):
            def record(_module: Any, inputs: tuple[Any, ...], key: str = name) -> None:
                amax[key] = max(amax.get(key, 0.0), float(inputs[0].abs().max()))
            hooks.append(module.register_forward_pre_hook(record))
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens].to(device)
            model(ids)
    for hook in hooks:
        hook.remove()
    del model
    return {name: max(value, 1e-12) / E4M3_MAX for name, value in amax.items()}


def write_fp8_checkpoint(source: Path, dest: Path, scheme_name: str, *, calibration: Iterable[str] = (),
                         device: str = "cpu") -> Path:
    """Quantize the checkpoint in ``source`` into the new directory ``dest`` (built in a
    temporary sibling and renamed into place, so a half-written one never appears)."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    scheme = SCHEMES.get(scheme_name)
    if scheme is None:
        raise QuantizeError(f"unknown scheme {scheme_name!r}; expected one of {', '.join(SCHEMES)}")
    source, dest = Path(source).resolve(), Path(dest).resolve()
    config = _read_config(source)
    if dest.exists():
        raise QuantizeError(f"{dest}: already exists; the checkpoint is written into a new directory only")
    shards = safetensors_files(source)
    if not shards:
        raise QuantizeError(f"{source}: no *.safetensors files")
    input_scales: dict[str, float] = {}
    if not scheme.dynamic_activations:
        texts = list(calibration)
        if not texts:
            raise QuantizeError(f"scheme {scheme.name} needs calibration text for its static activation scales")
        input_scales = activation_scales(source, texts, device)
    with atomic_directory(dest) as work:
        weight_map = {}
        for shard in shards:
            tensors = {}
            with safe_open(str(shard), framework="pt", device=device) as handle:
                for name in handle.keys():
                    tensor = handle.get_tensor(name)
                    if not is_quantized_weight(name, tuple(tensor.shape)):
                        tensors[name] = tensor.cpu()
                        continue
                    quantized, scale = quantize_weight(tensor, scheme.weight_strategy)
                    module = name.rpartition(".")[0]
                    tensors[name] = quantized.cpu()
                    tensors[f"{module}.weight_scale"] = scale.cpu()
                    if not scheme.dynamic_activations:
                        if module not in input_scales:
                            raise QuantizeError(f"calibration never reached layer {module}")
                        tensors[f"{module}.input_scale"] = torch.tensor([input_scales[module]], dtype=torch.float32)
            save_file(tensors, str(work / shard.name), metadata={"format": "pt"})
            weight_map.update({name: shard.name for name in tensors})
        if (source / "model.safetensors.index.json").is_file():
            index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
            (work / "model.safetensors.index.json").write_text(json.dumps(index, indent=1), encoding="utf-8")
        for extra in source.iterdir():
            if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in (
                    "config.json", "model.safetensors.index.json", MARKER):
                shutil.copy2(extra, work / extra.name)
        has_router = any(name.endswith(".mlp.gate.weight") for name in weight_map)
        config["quantization_config"] = quantization_config(scheme, has_router=has_router)
        (work / "config.json").write_text(json.dumps(config, indent=1), encoding="utf-8")
        (work / MARKER).write_text(json.dumps({"source": str(source), "scheme": scheme.name}), encoding="utf-8")
    return dest


def _read_config(source: Path) -> dict[str, Any]:
    try:
        config = check_model_dir(source)
    except CheckpointError as err:
        raise QuantizeError(str(err)) from None
    if config.get("quantization_config"):
        raise QuantizeError(f"{source / 'config.json'}: already quantized "
                            f"({config['quantization_config'].get('quant_method')})")
    return config
