"""Check a local checkpoint directory before an engine is asked to load it.

vLLM finds a missing config.json, or a truncated or garbage safetensors file,
only after the baseline engine has run for minutes, and reports it as a
traceback; these checks read only config.json and the safetensors headers
(with roofline's readers).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import CheckpointError, RooflineError
from .roofline import read_header, read_json, safetensors_files, text_config

_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth")


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
    with shard.open("rb") as handle:
        header_bytes = int.from_bytes(handle.read(8), "little")
    offsets = [info.get("data_offsets") for info in header.values() if isinstance(info, dict)]
    ends = [pair[1] for pair in offsets if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], int)]
    needed = 8 + header_bytes + max(ends, default=0)
    size = shard.stat().st_size
    if size < needed:
        raise CheckpointError(f"{shard}: truncated: {size} bytes, its header describes {needed}")


def vocab_size(config: dict[str, Any]) -> int | None:
    """``vocab_size`` of a model config (multimodal configs keep it in text_config)."""
    value = text_config(config).get("vocab_size") or config.get("vocab_size")
    return value if isinstance(value, int) and not isinstance(value, bool) else None
