"""Check a local checkpoint directory before an engine is asked to load it.

vLLM finds a missing config.json, or a truncated or garbage safetensors file,
only after the baseline engine has run for minutes, and reports it as a
traceback; these checks read only config.json and the safetensors headers
(with the readers below, which the roofline and the engine checks share).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from .errors import CheckpointError, RooflineError

_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")
_MAX_HEADER = 100_000_000  # the safetensors format's own cap on header size


def read_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise RooflineError(f"{path}: not found (expected a model directory or its config.json)") from None
    except (OSError, ValueError) as err:
        raise RooflineError(f"{path}: cannot read JSON: {err}") from None
    if not isinstance(raw, dict):
        raise RooflineError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def text_config(cfg: dict) -> dict:
    # Multimodal wrappers nest the language model's config.
    return cfg.get("text_config") or cfg


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        # The index names the shards; other *.safetensors files (e.g. a
        # consolidated copy) would count the weights twice.
        weight_map = read_json(index).get("weight_map", {})
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    return sorted(model_dir.glob("*.safetensors"))


def header_bytes(path: Path) -> bytes:
    """The raw header block of a safetensors file: 8-byte little-endian length, then that many bytes."""
    try:
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                raise RooflineError(f"{path}: too short for a safetensors file")
            (length,) = struct.unpack("<Q", prefix)
            if length > _MAX_HEADER:
                raise RooflineError(f"{path}: header length {length} is not plausible for safetensors")
            return f.read(length)
    except OSError as err:
        raise RooflineError(f"{path}: cannot read: {err}") from None


def data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins (the offsets in its header count from here)."""
    return 8 + len(header_bytes(path))


def read_header(path: Path) -> dict[str, dict]:
    """The JSON header of a safetensors file (tensor names, dtypes, shapes, offsets)."""
    try:
        header = json.loads(header_bytes(path))
    except RooflineError:
        raise  # a ValueError too, but already names the file
    except ValueError as err:
        raise RooflineError(f"{path}: header is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise RooflineError(f"{path}: header is not a JSON object")
    header.pop("__metadata__", None)
    return header




# Names vLLM loads as an attention layer's KV-cache scales (weight_utils.maybe_remap_kv_scale_name).
_KV_SCALE_ENDINGS = (".k_scale", ".v_scale", ".kv_scale", ".k_cache.scale", ".v_cache.scale")
_SCALE_DTYPES = {"F32": "<f4", "F16": "<f2", "F64": "<f8"}


def kv_cache_scales(model_dir: Path) -> list[float]:
    """The values of a checkpoint's stored KV-cache scales (k_scale, v_scale, ...), read from the
    safetensors data; [] when it stores none. BF16 scales are widened to float32."""
    import numpy as np

    values: list[float] = []
    for shard in safetensors_files(model_dir):
        header = read_header(shard)
        scales = {name: info for name, info in header.items() if name.endswith(_KV_SCALE_ENDINGS)}
        if not scales:
            continue
        start = data_start(shard)
        with shard.open("rb") as handle:
            for name, info in sorted(scales.items()):
                begin, end = info["data_offsets"]
                handle.seek(start + begin)
                raw = handle.read(end - begin)
                if info["dtype"] == "BF16":
                    array = (np.frombuffer(raw, "<u2").astype(np.uint32) << 16).view(np.float32)
                elif info["dtype"] in _SCALE_DTYPES:
                    array = np.frombuffer(raw, _SCALE_DTYPES[info["dtype"]])
                else:
                    raise RooflineError(f"{shard}: KV-cache scale {name!r} has dtype {info['dtype']!r}")
                values += [float(v) for v in array.ravel()]
    return values


def weights_dir(model: str) -> Path:
    """A local checkpoint directory, or the Hugging Face cache snapshot the engine loaded."""
    path = Path(model)
    if path.is_dir():
        return path
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, local_files_only=True))


def check_model_dir(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's config.json; CheckpointError unless it has one and complete weights."""
    if not model_dir.is_dir():
        raise CheckpointError(f"{model_dir}: expected a checkpoint directory, got a file")
    try:
        config = read_json(model_dir / "config.json")
        shards = safetensors_files(model_dir)
        for shard in shards:
            _check_length(shard, read_header(shard))
    except RooflineError as err:
        raise CheckpointError(str(err)) from None
    if not shards and not any(next(model_dir.glob(pattern), None) for pattern in _OTHER_WEIGHTS):
        raise CheckpointError(f"{model_dir}: no weights (*.safetensors or *.bin files)")
    return config


def _check_length(shard: Path, header: dict[str, Any]) -> None:
    # The header's data offsets say how long the file must be, so a truncated one shows here.
    offsets = [info.get("data_offsets") for info in header.values() if isinstance(info, dict)]
    ends = [pair[1] for pair in offsets if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)]
    needed = data_start(shard) + max(ends, default=0)
    size = shard.stat().st_size
    if size < needed:
        raise CheckpointError(f"{shard}: truncated: {size} bytes, its header describes {needed}")


def vocab_size(config: dict[str, Any]) -> int | None:
    """``vocab_size`` of a model config (multimodal configs keep it in text_config)."""
    value = text_config(config).get("vocab_size") or config.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


UNKNOWN_VOCAB = 1 << 30  # a model whose config is not at hand is treated as large


def vocab_size_hint(model: str) -> int:
    """The vocabulary size from a local checkpoint's config.json, before any engine starts."""
    config = Path(model) / "config.json"
    if config.is_file():
        return vocab_size(read_json(config)) or UNKNOWN_VOCAB
    return UNKNOWN_VOCAB
