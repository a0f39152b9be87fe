"""Decode-speed ceiling of a model: memory bandwidth / bytes read per token.

At batch 1 every decoded token reads each linear weight (with its scales), the
lm_head, one embedding row, the norms and the KV cache of the earlier tokens
once, and the arithmetic is small next to that; so the bytes read bound tok/s.
Sizes come from safetensors headers when a model directory holds them, else
from a Llama-style config.json alone.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from . import gpu_bandwidths
from .checkpoint import read_header, read_json, safetensors_files, text_config
from .errors import RooflineError

# vLLM's online quantization schemes that turn 16-bit linear weights into FP8.
ONLINE_FP8 = frozenset({"fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"})
_BLOCK = 128  # fp8_per_block uses 128x128 weight blocks
_SCALE_BYTES = 4  # online schemes keep float32 scales

_SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_TORCH_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_EMBEDDING_MODULES = frozenset({"embed_tokens", "wte", "word_embeddings"})


@dataclass(frozen=True)
class _Tensor:
    role: str  # "linear", "lm_head", "embedding" or "other"
    shape: tuple[int, ...]
    itemsize: int
    is_weight: bool = True  # False for scales and biases stored beside a weight

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RooflineEstimate:
    source: str  # "safetensors" or "config.json"
    quantization: str | None
    linear_params: int
    lm_head_params: int  # the embedding table's size when the two are tied
    embedding_params: int
    other_params: int  # norms and everything else that is no matmul weight
    bytes_per_token: int  # read per decoded token at batch 1, KV cache included
    weight_bytes: int  # resident weights, whole embedding table included
    kv_bytes_per_context_token: int
    context_tokens: int
    gpu: str | None
    bandwidth_gbps: float | None

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes_per_context_token * self.context_tokens

    @property
    def weight_gib(self) -> float:
        return self.weight_bytes / 2**30

    @property
    def ceiling_tok_s(self) -> float | None:
        if self.bandwidth_gbps is None:
            return None
        return self.bandwidth_gbps * 1e9 / self.bytes_per_token

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_gib": self.weight_gib,
            "ceiling_tok_s": self.ceiling_tok_s,
        }


def decode_context_tokens(input_len: int, output_len: int) -> int:
    """Mean context over a decode: the step that writes token j of the output reads
    the KV cache of input_len + j - 1 tokens, for j = 2 .. output_len (token 1 comes
    from prefill)."""
    if input_len < 0 or output_len < 1:
        raise RooflineError(f"need input_len >= 0 and output_len >= 1, got {input_len} and {output_len}")
    return round(input_len + output_len / 2)


def estimate_from_path(
    path: Path | str,
    quantization: str | None = None,
    gpu: str | None = None,
    bandwidth_gbps: float | None = None,
    context_tokens: int = 0,
    kv_cache_dtype: str | None = None,
) -> RooflineEstimate:
    """Estimate bytes per decoded token and the bandwidth ceiling for a model.

    ``path`` is a model directory (its safetensors headers are used when present)
    or a config.json (sizes from the config alone). ``quantization`` names a vLLM
    online FP8 scheme applied to 16-bit linear weights. ``gpu`` is looked up in
    the bandwidth table; ``bandwidth_gbps`` > 0 overrides it.
    """
    if context_tokens < 0:
        raise RooflineError(f"context_tokens must be >= 0, got {context_tokens}")
    path = Path(path).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    cfg = text_config(read_json(config_path))
    scheme = online_scheme(quantization)
    shards = safetensors_files(path) if path.is_dir() else []
    if shards:
        tensors, source = _tensors_from_safetensors(shards), "safetensors"
    else:
        tensors, source = _tensors_from_config(cfg, config_path), "config.json"
        scheme = scheme or _checkpoint_fp8_scheme(cfg, config_path)
    gpu_name, bandwidth = _bandwidth(gpu, bandwidth_gbps)

    def total(role: str) -> int:
        return sum(_stored_bytes(t, scheme) for t in tensors if t.role == role)

    def params(role: str) -> int:
        return sum(t.numel for t in tensors if t.role == role and t.is_weight)

    embedding = next((t for t in tensors if t.role == "embedding" and t.is_weight), None)
    if embedding is None:
        raise RooflineError(f"{path}: found no embedding table (embed_tokens)")
    tied = not any(t.role == "lm_head" for t in tensors)
    # A tied lm_head is the embedding table read in full once more per token.
    lm_head_bytes = total("embedding") if tied else total("lm_head")
    embedding_row_bytes = embedding.numel // embedding.shape[0] * embedding.itemsize
    kv_per_context_token = _kv_bytes_per_context_token(cfg, config_path, kv_cache_dtype)
    return RooflineEstimate(
        source=source,
        quantization=quantization or None,
        linear_params=params("linear"),
        lm_head_params=params("embedding" if tied else "lm_head"),
        embedding_params=params("embedding"),
        other_params=params("other"),
        bytes_per_token=total("linear")
        + lm_head_bytes
        + embedding_row_bytes
        + total("other")
        + kv_per_context_token * context_tokens,
        weight_bytes=sum(_stored_bytes(t, scheme) for t in tensors),
        kv_bytes_per_context_token=kv_per_context_token,
        context_tokens=context_tokens,
        gpu=gpu_name,
        bandwidth_gbps=bandwidth,
    )


def online_scheme(quantization: str | None) -> str | None:
    """The online FP8 scheme named by a vLLM ``quantization``; RooflineError for one with no byte model."""
    if not quantization:
        return None
    if quantization not in ONLINE_FP8:
        raise RooflineError(
            f"quantization {quantization!r} has no byte model here; expected one of {sorted(ONLINE_FP8)}"
        )
    return quantization


def _stored_bytes(tensor: _Tensor, scheme: str | None) -> int:
    """Bytes of a tensor after online quantization (if any) of 16/32-bit linear weights."""
    if scheme is None or tensor.role != "linear" or not tensor.is_weight or tensor.itemsize == 1:
        return tensor.numel * tensor.itemsize
    out_features, in_features = tensor.shape
    if scheme == "fp8_per_channel":
        scales = out_features
    elif scheme == "fp8_per_block":
        scales = math.ceil(out_features / _BLOCK) * math.ceil(in_features / _BLOCK)
    else:  # fp8 and fp8_per_tensor: one scale per weight matrix
        scales = 1
    return tensor.numel + scales * _SCALE_BYTES


def _require(cfg: dict, key: str, config_path: Path) -> int:
    try:
        value = int(cfg[key])
    except (KeyError, TypeError, ValueError):
        raise RooflineError(
            f"{config_path}: needs an integer {key!r} (only Llama-style decoder configs are supported)"
        ) from None
    if value <= 0:
        raise RooflineError(f"{config_path}: {key} must be a positive integer, got {cfg[key]!r}")
    return value


def _model_itemsize(cfg: dict, config_path: Path) -> int:
    # transformers wrote "torch_dtype" before v5 and writes "dtype" since.
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _TORCH_BYTES:
        raise RooflineError(f"{config_path}: unsupported dtype {dtype!r}")
    return _TORCH_BYTES[dtype]


def _attention_shape(cfg: dict, config_path: Path) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim)."""
    heads = _require(cfg, "num_attention_heads", config_path)
    kv_heads = _require(cfg, "num_key_value_heads", config_path) if cfg.get("num_key_value_heads") else heads
    head_dim = _require(cfg, "head_dim", config_path) if cfg.get("head_dim") else (
        _require(cfg, "hidden_size", config_path) // heads)
    return heads, kv_heads, head_dim


def _tensors_from_config(cfg: dict, config_path: Path) -> list[_Tensor]:
    hidden = _require(cfg, "hidden_size", config_path)
    intermediate = _require(cfg, "intermediate_size", config_path)
    layers = _require(cfg, "num_hidden_layers", config_path)
    vocab = _require(cfg, "vocab_size", config_path)
    heads, kv_heads, head_dim = _attention_shape(cfg, config_path)
    size = _model_itemsize(cfg, config_path)

    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]
    mlp = [(intermediate, hidden), (intermediate, hidden), (hidden, intermediate)]
    per_layer = [_Tensor("linear", shape, size) for shape in attention + mlp]
    if cfg.get("attention_bias"):
        per_layer += [_Tensor("linear", (out,), size, False) for out, _ in attention]
    if cfg.get("mlp_bias"):
        per_layer += [_Tensor("linear", (out,), size, False) for out, _ in mlp]
    per_layer += [_Tensor("other", (hidden,), size)] * 2  # input and post-attention norms

    tensors = per_layer * layers
    tensors += [_Tensor("other", (hidden,), size), _Tensor("embedding", (vocab, hidden), size)]
    if not cfg.get("tie_word_embeddings", False):
        tensors.append(_Tensor("lm_head", (vocab, hidden), size))
    return tensors


def _checkpoint_fp8_scheme(cfg: dict, config_path: Path) -> str | None:
    """The online scheme whose byte layout matches a pre-quantized FP8 checkpoint.

    Needed only without safetensors headers; with them the stored dtypes tell.
    """
    qcfg = cfg.get("quantization_config")
    if not qcfg:
        return None
    method = qcfg.get("quant_method")
    if method == "fp8":
        return "fp8_per_block" if qcfg.get("weight_block_size") else "fp8_per_tensor"
    if method == "compressed-tensors":
        for group in (qcfg.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("type") == "float" and weights.get("num_bits") == 8:
                strategy: str = weights.get("strategy") or ""
                return {"channel": "fp8_per_channel", "block": "fp8_per_block"}.get(strategy, "fp8_per_tensor")
    raise RooflineError(
        f"{config_path}: quantization_config {method!r} is not FP8; "
        "point at the model directory with its safetensors files instead"
    )


def kv_cache_itemsize(kv_cache_dtype: str | None) -> int | None:
    """Bytes per stored KV element for a vLLM ``kv_cache_dtype``; None: the model's own dtype."""
    if kv_cache_dtype in (None, "", "auto"):
        return None
    assert kv_cache_dtype is not None
    if kv_cache_dtype.startswith("fp8"):
        return 1
    if kv_cache_dtype in _TORCH_BYTES:
        return _TORCH_BYTES[kv_cache_dtype]
    raise RooflineError(f"unsupported kv_cache_dtype {kv_cache_dtype!r}; expected auto, fp8*, "
                        f"or one of {', '.join(sorted(_TORCH_BYTES))}")


def _kv_bytes_per_context_token(cfg: dict, config_path: Path, kv_cache_dtype: str | None) -> int:
    layers = _require(cfg, "num_hidden_layers", config_path)
    _, kv_heads, head_dim = _attention_shape(cfg, config_path)
    itemsize = kv_cache_itemsize(kv_cache_dtype) or _model_itemsize(cfg, config_path)
    return 2 * layers * kv_heads * head_dim * itemsize  # keys and values


def _tensors_from_safetensors(shards: list[Path]) -> list[_Tensor]:
    entries: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in shards:
        for name, info in read_header(shard).items():
            dtype = info.get("dtype")
            if dtype not in _SAFETENSORS_BYTES:
                raise RooflineError(f"{shard}: tensor {name!r} has unsupported dtype {dtype!r}")
            entries[name] = (dtype, tuple(info.get("shape", ())))

    # A module is a linear layer when its ".weight" is a matrix; its scales and
    # bias are read with it.
    linear_modules = {
        name.rpartition(".")[0]
        for name, (_, shape) in entries.items()
        if name.endswith(".weight") and len(shape) == 2
    }
    tensors = []
    for name, (dtype, shape) in entries.items():
        module, _, leaf = name.rpartition(".")
        leaf_module = module.rpartition(".")[2]
        if leaf_module in _EMBEDDING_MODULES:
            role = "embedding"
        elif leaf_module == "lm_head":
            role = "lm_head"
        elif module in linear_modules:
            role = "linear"
        else:
            role = "other"
        is_weight = leaf == "weight" or role == "other"
        tensors.append(_Tensor(role, shape, _SAFETENSORS_BYTES[dtype], is_weight))
    return tensors


def _bandwidth(gpu: str | None, bandwidth_gbps: float | None) -> tuple[str | None, float | None]:
    if bandwidth_gbps is not None and not (math.isfinite(bandwidth_gbps) and bandwidth_gbps >= 0):
        raise RooflineError(f"bandwidth_gbps must be >= 0 and finite, got {bandwidth_gbps}")
    entry = gpu_bandwidths.find_gpu(gpu) if gpu else None
    if bandwidth_gbps:  # an explicit figure wins over the table
        return (entry.name if entry else gpu), float(bandwidth_gbps)
    if entry:
        return entry.name, entry.bandwidth_gbps
    if gpu:
        raise RooflineError(
            f"unknown GPU {gpu!r}; give its bandwidth in GB/s or use one of: {', '.join(gpu_bandwidths.known_names())}"
        )
    return None, None
