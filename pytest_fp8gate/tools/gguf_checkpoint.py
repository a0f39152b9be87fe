"""A Llama GGUF file as a BF16 Hugging Face checkpoint directory that any vLLM loads.

vLLM's CPU backend cannot read GGUF (its GGUF support moved to a CUDA-only plugin), so
the gate reads a converted directory instead. The weights are dequantized with the
``gguf`` package's own numpy reference (``gguf.quants.dequantize``) and rounded once
to BF16; llama.cpp's converter interleaves the rows of the q and k projections for its
rotary layout, which is undone here as transformers' GGUF loader undoes it. The
tokenizer comes from transformers' GGUF tokenizer converter, so its files are those
transformers itself would write. A quantized GGUF's BF16 weights lie on its
quantization grid: a real trained distribution, not the model's original BF16.

The directory is written atomically, with a marker (``MARKER``) naming the GGUF's
sha256 last; ``convert_gguf`` reuses a complete directory for the same file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..atomic import atomic_directory, atomic_write_text
from ..engines.provenance import file_sha256
from ..errors import CheckpointError

if TYPE_CHECKING:
    import numpy as np

__all__ = ["MARKER", "cached_conversion", "convert_gguf", "llama_config", "unpermute_rotary"]

MARKER = ".fp8gate-gguf.json"  # written last: names the GGUF a complete directory came from

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_VOCABULARY_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")  # the tokenizer's
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.weight$")


def cached_conversion(gguf_path: Path, cache_root: Path) -> Path:
    """The BF16 checkpoint of ``gguf_path`` under ``cache_root``, in a directory named for the file's
    sha256: converted on the first call, reused on every later one."""
    gguf_path = Path(gguf_path)
    sha256 = file_sha256(gguf_path)
    return convert_gguf(gguf_path, Path(cache_root) / f"{gguf_path.stem}-{sha256[:16]}-bf16", sha256)


def convert_gguf(gguf_path: Path, out_dir: Path, sha256: str | None = None) -> Path:
    """Write (or reuse) the BF16 checkpoint of the Llama GGUF ``gguf_path`` at ``out_dir``.

    A directory whose marker names the same sha256 is returned as it is; any other existing
    ``out_dir`` is refused, so a mistyped path never replaces a checkpoint. Raises CheckpointError
    for a GGUF that is not a Llama with the tensors a Llama has.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    marker = {"gguf": gguf_path.name, "gguf_sha256": sha256 or file_sha256(gguf_path), "dtype": "bfloat16"}
    if _read_marker(out_dir) == marker:
        return out_dir
    if out_dir.exists():
        raise CheckpointError(f"{out_dir}: exists and is not this GGUF's conversion (no matching {MARKER}); "
                        "give a new directory")
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    fields = {name: field.contents() for name, field in reader.fields.items()
              if name not in _VOCABULARY_FIELDS}
    config = llama_config(fields, {tensor.name for tensor in reader.tensors}, gguf_path)
    try:
        with atomic_directory(out_dir) as work:
            _write_weights(reader, config, gguf_path, work / "model.safetensors")
            atomic_write_text(work / "config.json", json.dumps(config, indent=2) + "\n")
            generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
            atomic_write_text(work / "generation_config.json", json.dumps(generation, indent=2) + "\n")
            _write_tokenizer(gguf_path, work)
            atomic_write_text(work / MARKER, json.dumps(marker, indent=2) + "\n")
    except OSError:
        if _read_marker(out_dir) != marker:  # not another process's copy of the same conversion
            raise
    return out_dir


def llama_config(fields: dict[str, Any], tensor_names: set[str], source: Path) -> dict[str, Any]:
    """The ``config.json`` of a Llama GGUF's metadata ``fields`` (tied embeddings when it has no
    ``output.weight``)."""
    def field(key: str) -> Any:
        if key not in fields:
            raise CheckpointError(f"{source}: metadata key {key!r} missing; expected a llama.cpp Llama GGUF")
        return fields[key]

    if field("general.architecture") != "llama":
        raise CheckpointError(f"{source}: general.architecture is {fields['general.architecture']!r}; "
                        "only 'llama' converts")
    heads = int(field("llama.attention.head_count"))
    hidden = int(field("llama.embedding_length"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(field("llama.feed_forward_length")),
        "num_hidden_layers": int(field("llama.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(fields.get("llama.attention.head_count_kv", heads)),
        "head_dim": int(fields.get("llama.rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "max_position_embeddings": int(field("llama.context_length")),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": float(fields.get("llama.rope.freq_base", 10000.0)),
        "vocab_size": int(fields.get("llama.vocab_size", 0)) or None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(field("tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field("tokenizer.ggml.eos_token_id")),
        "torch_dtype": "bfloat16",
    }


def unpermute_rotary(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's row order of a q or k projection (``heads`` of them in the matrix): it
    interleaves each head's two rotary halves, HF's Llama keeps them as two blocks."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _hf_name(name: str, source: Path) -> str:
    match = _BLOCK.match(name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"
    stem = name.removesuffix(".weight")
    if stem in _TOP_NAMES and name.endswith(".weight"):
        return f"{_TOP_NAMES[stem]}.weight"
    raise CheckpointError(f"{source}: tensor {name!r} has no place in a Llama checkpoint")


def _write_weights(reader: Any, config: dict[str, Any], source: Path, path: Path) -> None:
    import numpy as np
    import torch
    from gguf.quants import dequantize
    from safetensors.torch import save

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    tensors = {}
    for tensor in reader.tensors:
        weight = dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))
        match = _BLOCK.match(tensor.name)
        if match and match.group(2) in heads:
            weight = unpermute_rotary(weight, heads[match.group(2)])
        tensors[_hf_name(tensor.name, source)] = torch.from_numpy(np.array(weight, dtype=np.float32)).to(torch.bfloat16)
    with path.open("wb") as handle:  # inside the atomic directory: published with it
        handle.write(save(tensors, metadata={"format": "pt"}))


def _write_tokenizer(gguf_path: Path, work: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(work))
    # transformers 5 names its generic class TokenizersBackend, which transformers 4 (CUDA vLLM 0.26's) lacks;
    # PreTrainedTokenizerFast is that class in both and reads tokenizer.json as written.
    settings = json.loads((work / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    for key in ("is_local", "local_files_only"):  # how this load ran, not what the tokenizer is
        settings.pop(key, None)
    atomic_write_text(work / "tokenizer_config.json", json.dumps(settings, indent=2) + "\n")


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
