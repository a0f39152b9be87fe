"""Decode-speed ceiling of a model: memory bandwidth / bytes read per token.

At batch 1 every decoded token reads each linear weight (with its scales), the
lm_head, one embedding row, the norms and the KV cache of the earlier tokens
once, and the arithmetic is small next to that; so the bytes read bound tok/s.
A sliding-window attention layer reads the KV cache of its window only.
Sizes come from safetensors headers when a model directory holds them, else
from a Llama-style config.json alone (DeepSeek's MLA attention included).

A mixture-of-experts layer reads only the routed experts its tokens chose: k of
N at batch 1, and at batch B the expected number of distinct experts that B
tokens touch when each picks k of N uniformly, nEff = N (1 - ((N - k) / N)^B)
(a model: real routers are not uniform, so it bounds the reads from below for
a skewed router, which touches fewer distinct experts). Shared experts, the
router and dense layers are read at every step.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .. import gpu_bandwidths
from ..checkpoint import read_header, read_json, safetensors_files, text_config
from ..errors import RooflineError

# vLLM's online quantization schemes that turn 16-bit linear weights into FP8.
ONLINE_FP8 = frozenset({"fp8", "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"})
_BLOCK = 128  # fp8_per_block uses 128x128 weight blocks
_SCALE_BYTES = 4  # online schemes keep float32 scales
# vLLM's default share of a GPU's memory for weights, activations and KV cache (0.9; 0.92 since 0.33):
# the weights on one GPU must fit inside it.
GPU_MEMORY_UTILIZATION = 0.9

_SAFETENSORS_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}  # fmt: skip
_TORCH_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2}
_EMBEDDING_MODULES = frozenset({"embed_tokens", "wte", "word_embeddings"})
# One routed expert's tensor, as transformers and vLLM name them (Qwen-MoE and DeepSeek
# ".mlp.experts.<e>.", Mixtral ".block_sparse_moe.experts.<e>.").
_ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.")


@dataclass(frozen=True)
class _Tensor:
    role: str  # "linear", "lm_head", "embedding" or "other"
    shape: tuple[int, ...]
    itemsize: int
    is_weight: bool = True  # False for scales and biases stored beside a weight
    routed_expert: bool = False  # read only when the router picks its expert

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
    kv_bytes_per_context_token: int  # stored, over every layer
    context_tokens: int
    gpu: str | None
    bandwidth_gbps: float | None
    # Mixture of experts (0 for a dense model): routed experts per MoE layer, how many a token
    # picks, their parameters and stored bytes over all layers (all counted in the totals above).
    experts: int = 0
    experts_per_token: int = 0
    routed_expert_params: int = 0
    routed_expert_bytes: int = 0
    batch: int = 1  # sequences decoded together, for bytes_per_step and the ceiling
    # Read by one decode step of ``batch`` sequences: nEff experts, each sequence's KV cache.
    bytes_per_step: int = 0
    # Sliding-window attention: the window in tokens, and the share of kv_bytes_per_context_token held by
    # the layers that attend over it only (0 for none).
    sliding_window: int = 0
    sliding_kv_bytes_per_context_token: int = 0
    gpu_memory_gib: float | None = None  # one GPU's, where the GPU is known

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one sequence reads per decoded token: the full-attention layers' over the
        whole context, the sliding-window layers' over their window."""
        sliding = self.sliding_kv_bytes_per_context_token
        window = min(self.context_tokens, self.sliding_window)
        return (self.kv_bytes_per_context_token - sliding) * self.context_tokens + sliding * window

    @property
    def tensor_parallel_to_fit(self) -> int | None:
        """The fewest GPUs (a power of two, as vLLM splits attention heads evenly) whose memory share
        (GPU_MEMORY_UTILIZATION) holds the weights; None where the GPU is unknown."""
        if self.gpu_memory_gib is None:
            return None
        share, size = self.gpu_memory_gib * 2**30 * GPU_MEMORY_UTILIZATION, 1
        while self.weight_bytes / size > share:
            size *= 2
        return size

    @property
    def active_experts(self) -> float:
        """Expected distinct routed experts a decode step of ``batch`` sequences reads, per MoE layer."""
        return expected_active_experts(self.experts, self.experts_per_token, self.batch) if self.experts else 0.0

    @property
    def weight_gib(self) -> float:
        return self.weight_bytes / 2**30

    @property
    def ceiling_tok_s(self) -> float | None:
        """Decoded tokens per second per sequence at ``batch`` (at batch 1, per token)."""
        if self.bandwidth_gbps is None:
            return None
        return self.bandwidth_gbps * 1e9 / self.bytes_per_step

    def as_dict(self) -> dict[str, object]:
        return {
            **asdict(self),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "active_experts": self.active_experts,
            "weight_gib": self.weight_gib,
            "ceiling_tok_s": self.ceiling_tok_s,
            "tensor_parallel_to_fit": self.tensor_parallel_to_fit,
        }


def weights_overflow(estimate: RooflineEstimate, parallel: int = 1) -> str | None:
    """Why the weights do not fit ``parallel`` GPUs of the estimate's kind, and how many hold them; None where
    they fit or the GPU is unknown."""
    fit = estimate.tensor_parallel_to_fit
    if fit is None or fit <= parallel:
        return None
    assert estimate.gpu_memory_gib is not None
    share = estimate.gpu_memory_gib * GPU_MEMORY_UTILIZATION
    gpus = f"one {estimate.gpu}" if parallel == 1 else f"{parallel} {estimate.gpu} GPUs"
    return (f"the weights ({estimate.weight_gib:.1f} GiB) do not fit {gpus} ({estimate.gpu_memory_gib:g} GiB each, "
            f"{share:.1f} GiB of it at vLLM's gpu_memory_utilization {GPU_MEMORY_UTILIZATION:g}); "
            f"tensor_parallel_size = {fit} holds them ({estimate.weight_gib / fit:.1f} GiB a GPU)")


def expected_active_experts(experts: int, per_token: int, batch: int) -> float:
    """nEff = N (1 - ((N - k) / N)^B): the expected distinct experts of N that B tokens touch, each
    choosing k of N uniformly at random (k at B = 1, towards N as B grows)."""
    if not 0 < per_token <= experts or batch < 1:
        raise RooflineError(f"need 0 < experts_per_token <= experts and batch >= 1, "
                            f"got {per_token}, {experts} and {batch}")
    return experts * (1 - ((experts - per_token) / experts) ** batch)


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
    batch: int = 1,
) -> RooflineEstimate:
    """Estimate bytes per decoded token and the bandwidth ceiling for a model.

    ``path`` is a model directory (its safetensors headers are used when present)
    or a config.json (sizes from the config alone). ``quantization`` names a vLLM
    online FP8 scheme applied to 16-bit linear weights. ``gpu`` is looked up in
    the bandwidth table; ``bandwidth_gbps`` > 0 overrides it. ``batch`` sequences decode
    together: the step reads each one's KV cache and, for a mixture of experts, nEff experts.
    """
    if context_tokens < 0:
        raise RooflineError(f"context_tokens must be >= 0, got {context_tokens}")
    if batch < 1:
        raise RooflineError(f"batch must be >= 1, got {batch}")
    path = Path(path).expanduser()
    config_path = path / "config.json" if path.is_dir() else path
    cfg = text_config(read_json(config_path))
    scheme = online_scheme(quantization)
    moe = moe_layout(cfg, config_path)
    shards = safetensors_files(path) if path.is_dir() else []
    if shards:
        tensors, source = _tensors_from_safetensors(shards), "safetensors"
    else:
        tensors, source = _tensors_from_config(cfg, config_path, moe), "config.json"
        scheme = scheme or _checkpoint_fp8_scheme(cfg, config_path)
    routed = [t for t in tensors if t.routed_expert]
    if moe is None and routed:
        raise RooflineError(f"{path}: holds routed-expert tensors but {config_path} names no experts "
                            "(num_experts, num_local_experts or n_routed_experts)")
    if moe is not None and not routed:
        raise RooflineError(f"{path}: {config_path} names {moe.experts} experts but no tensor is one expert's "
                            "(named .experts.<e>.); fused expert tensors have no byte model here")
    gpu_name, bandwidth, memory = _bandwidth(gpu, bandwidth_gbps)

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
    layers = _require(cfg, "num_hidden_layers", config_path)
    window, sliding_layers = sliding_window_layers(cfg, layers)
    sliding_kv = kv_per_context_token // layers * len(sliding_layers)  # every layer caches alike
    routed_bytes = sum(_stored_bytes(t, scheme) for t in routed)

    def weights_read(at_batch: int) -> int:
        """Weight bytes one decode step reads: a MoE layer nEff of its N experts', the rest in full."""
        unread = 0.0 if moe is None else 1 - expected_active_experts(moe.experts, moe.per_token, at_batch) / moe.experts
        return round(total("linear") + lm_head_bytes + embedding_row_bytes + total("other") - routed_bytes * unread)

    estimate = RooflineEstimate(
        source=source,
        # A pre-quantized checkpoint is labelled as vLLM names it (its quant_method).
        quantization=quantization or (cfg.get("quantization_config") or {}).get("quant_method"),
        linear_params=params("linear"),
        lm_head_params=params("embedding" if tied else "lm_head"),
        embedding_params=params("embedding"),
        other_params=params("other"),
        bytes_per_token=0,  # below, once the KV reads are known
        weight_bytes=sum(_stored_bytes(t, scheme) for t in tensors),
        kv_bytes_per_context_token=kv_per_context_token,
        context_tokens=context_tokens,
        gpu=gpu_name,
        bandwidth_gbps=bandwidth,
        experts=moe.experts if moe else 0,
        experts_per_token=moe.per_token if moe else 0,
        routed_expert_params=sum(t.numel for t in routed if t.is_weight),
        routed_expert_bytes=routed_bytes,
        batch=batch,
        sliding_window=window,
        sliding_kv_bytes_per_context_token=sliding_kv,
        gpu_memory_gib=memory,
    )
    kv_read = estimate.kv_bytes_per_token
    return replace(estimate, bytes_per_token=weights_read(1) + kv_read,
                   bytes_per_step=weights_read(batch) + batch * kv_read)


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


@dataclass(frozen=True)
class MoeLayout:
    """The routed experts of a mixture-of-experts config.json."""

    experts: int  # routed experts per MoE layer (N)
    per_token: int  # experts each token is routed to (k)
    layers: frozenset[int]  # decoder layers whose MLP is routed; the others are dense
    expert_intermediate: int  # one expert's FFN width
    shared_intermediate: int  # the shared experts' total FFN width, 0 for none
    shared_gate: bool  # Qwen2-MoE's one-output gate on its shared expert


def moe_layout(cfg: dict, config_path: Path) -> MoeLayout | None:
    """The config's experts (Qwen-MoE ``num_experts``, Mixtral ``num_local_experts``, DeepSeek
    ``n_routed_experts``), or None for a dense model."""
    key = next((k for k in ("n_routed_experts", "num_experts", "num_local_experts") if cfg.get(k)), None)
    if key is None:
        return None
    experts = _require(cfg, key, config_path)
    per_token = _require(cfg, "num_experts_per_tok", config_path)
    if per_token > experts:
        raise RooflineError(f"{config_path}: num_experts_per_tok {per_token} exceeds {key} {experts}")
    layers = _require(cfg, "num_hidden_layers", config_path)
    if key == "n_routed_experts":  # DeepSeek: dense below first_k_dense_replace, then every moe_layer_freq
        first_dense = int(cfg.get("first_k_dense_replace") or 0)
        every = int(cfg.get("moe_layer_freq") or 1)
        routed = {i for i in range(layers) if i >= first_dense and i % every == 0}
        shared = int(cfg.get("n_shared_experts") or 0) * _require(cfg, "moe_intermediate_size", config_path)
    else:  # Qwen-MoE: every decoder_sparse_step-th layer unless in mlp_only_layers; Mixtral: every layer
        every = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        routed = {i for i in range(layers) if (i + 1) % every == 0 and i not in dense}
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
    width_key = "moe_intermediate_size" if cfg.get("moe_intermediate_size") else "intermediate_size"
    return MoeLayout(experts, per_token, frozenset(routed), _require(cfg, width_key, config_path), shared,
                     shared > 0 and key == "num_experts")


def _attention_shape(cfg: dict, config_path: Path) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim)."""
    heads = _require(cfg, "num_attention_heads", config_path)
    kv_heads = _require(cfg, "num_key_value_heads", config_path) if cfg.get("num_key_value_heads") else heads
    head_dim = _require(cfg, "head_dim", config_path) if cfg.get("head_dim") else (
        _require(cfg, "hidden_size", config_path) // heads)
    return heads, kv_heads, head_dim


def _attention_tensors(cfg: dict, config_path: Path, hidden: int, size: int) -> list[_Tensor]:
    """One layer's attention weights: grouped-query attention, or DeepSeek's multi-head latent
    attention (low-rank query and key-value projections, stored as the checkpoint holds them)."""
    if cfg.get("kv_lora_rank"):
        heads = _require(cfg, "num_attention_heads", config_path)
        kv_rank = _require(cfg, "kv_lora_rank", config_path)
        rope, nope, value = (_require(cfg, k, config_path) for k in ("qk_rope_head_dim", "qk_nope_head_dim",
                                                                      "v_head_dim"))
        q_rank = int(cfg.get("q_lora_rank") or 0)
        query = [(q_rank, hidden), (heads * (nope + rope), q_rank)] if q_rank else [(heads * (nope + rope), hidden)]
        shapes = query + [(kv_rank + rope, hidden), (heads * (nope + value), kv_rank), (hidden, heads * value)]
        norms = [(q_rank,)] * bool(q_rank) + [(kv_rank,)]
        return [_Tensor("linear", shape, size) for shape in shapes] + [_Tensor("other", n, size) for n in norms]
    heads, kv_heads, head_dim = _attention_shape(cfg, config_path)
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    shapes = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out)]
    tensors = [_Tensor("linear", shape, size) for shape in shapes]
    if cfg.get("attention_bias"):
        tensors += [_Tensor("linear", (out,), size, False) for out, _ in shapes]
    if str(cfg.get("model_type", "")).startswith("qwen3"):  # Qwen3's per-head query and key norms
        tensors += [_Tensor("other", (head_dim,), size)] * 2
    return tensors


def _mlp(hidden: int, inner: int, size: int, bias: bool = False, routed_expert: bool = False) -> list[_Tensor]:
    shapes = [(inner, hidden), (inner, hidden), (hidden, inner)]  # gate, up, down
    tensors = [_Tensor("linear", shape, size, routed_expert=routed_expert) for shape in shapes]
    return tensors + [_Tensor("linear", (out,), size, False) for out, _ in shapes] * bias


def _moe_block(cfg: dict, moe: MoeLayout, hidden: int, size: int) -> list[_Tensor]:
    """A routed layer's router, its N experts and any shared experts."""
    tensors = [_Tensor("linear", (moe.experts, hidden), size)]  # the router
    if cfg.get("topk_method") == "noaux_tc":  # DeepSeek-V3's float32 routing bias
        tensors.append(_Tensor("other", (moe.experts,), 4))
    tensors += _mlp(hidden, moe.expert_intermediate, size, routed_expert=True) * moe.experts
    if moe.shared_intermediate:
        tensors += _mlp(hidden, moe.shared_intermediate, size)
    if moe.shared_gate:
        tensors.append(_Tensor("linear", (1, hidden), size))
    return tensors


def _tensors_from_config(cfg: dict, config_path: Path, moe: MoeLayout | None) -> list[_Tensor]:
    hidden = _require(cfg, "hidden_size", config_path)
    size = _model_itemsize(cfg, config_path)
    dense: list[_Tensor] = []
    if moe is None or len(moe.layers) < _require(cfg, "num_hidden_layers", config_path):
        dense = _mlp(hidden, _require(cfg, "intermediate_size", config_path), size, bool(cfg.get("mlp_bias")))
    layers = _require(cfg, "num_hidden_layers", config_path)
    vocab = _require(cfg, "vocab_size", config_path)
    attention = _attention_tensors(cfg, config_path, hidden, size)
    norms = [_Tensor("other", (hidden,), size)] * 2  # input and post-attention norms
    routed = _moe_block(cfg, moe, hidden, size) if moe else []

    tensors = []
    for layer in range(layers):
        tensors += attention + norms + (routed if moe and layer in moe.layers else dense)
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


def sliding_window_layers(cfg: dict, layers: int) -> tuple[int, frozenset[int]]:
    """(window in tokens, the decoder layers that attend over only that many recent tokens), as
    transformers and vLLM read a config: ``layer_types`` where written, else Gemma 3's
    ``sliding_window_pattern`` (every n-th layer global), Gemma 2's alternation (even layers local),
    Qwen2's layers from ``max_window_layers`` on, and otherwise every layer (Mistral); (0, none) without
    a window or with ``use_sliding_window = false``."""
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        return 0, frozenset()
    if cfg.get("use_sliding_window") is False:
        return 0, frozenset()
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return window, frozenset(i for i, layer_type in enumerate(types) if layer_type == "sliding_attention")
    pattern = cfg.get("sliding_window_pattern")
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 1:
        return window, frozenset(i for i in range(layers) if (i + 1) % pattern)
    if cfg.get("model_type") == "gemma2":
        return window, frozenset(range(0, layers, 2))
    if isinstance(cfg.get("max_window_layers"), int):
        return window, frozenset(range(cfg["max_window_layers"], layers))
    return window, frozenset(range(layers))


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
    itemsize = kv_cache_itemsize(kv_cache_dtype) or _model_itemsize(cfg, config_path)
    if cfg.get("kv_lora_rank"):  # MLA caches one latent and the shared rotary key per token and layer
        latent = _require(cfg, "kv_lora_rank", config_path) + _require(cfg, "qk_rope_head_dim", config_path)
        return layers * latent * itemsize
    _, kv_heads, head_dim = _attention_shape(cfg, config_path)
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
        routed_expert = role == "linear" and _ROUTED_EXPERT.search(name) is not None
        tensors.append(_Tensor(role, shape, _SAFETENSORS_BYTES[dtype], is_weight, routed_expert))
    return tensors


def _bandwidth(gpu: str | None, bandwidth_gbps: float | None) -> tuple[str | None, float | None, float | None]:
    """(the GPU's name, its bandwidth in GB/s, its memory in GiB where the table knows it)."""
    if bandwidth_gbps is not None and not (math.isfinite(bandwidth_gbps) and bandwidth_gbps >= 0):
        raise RooflineError(f"bandwidth_gbps must be >= 0 and finite, got {bandwidth_gbps}")
    entry = gpu_bandwidths.find_gpu(gpu) if gpu else None
    memory = entry.memory_gib if entry else None
    if bandwidth_gbps:  # an explicit figure wins over the table
        return (entry.name if entry else gpu), float(bandwidth_gbps), memory
    if entry:
        return entry.name, entry.bandwidth_gbps, memory
    if gpu:
        raise RooflineError(
            f"unknown GPU {gpu!r}; give its bandwidth in GB/s or use one of: {', '.join(gpu_bandwidths.known_names())}"
        )
    return None, None, None
