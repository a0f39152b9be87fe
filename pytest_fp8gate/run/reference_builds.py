"""Builds the gate writes from the baseline's own weights, stored as ordinary BF16 checkpoints.

Each is one rounding of every weight matrix (norms, biases and other vectors kept as they are), so it
loads in any engine without quantization support and works for any architecture whose weights are
safetensors: tied or untied embeddings, fused or split projections, stacked experts.

- ``q8_0``: llama.cpp's Q8_0 round trip (blocks of 32, one FP16 scale each), weights only, on every
  weight matrix whose rows split into blocks of 32, embeddings included, as llama-quantize rounds them
  for Q8_0. The article's reference format, measured on the gated model instead of read off Llama 3 8B.
- ``e4m3``: an ideal FP8 E4M3 round trip of the linear layers' weights with one scale per output
  channel (absmax / 448), weights only; embeddings and the output head kept, as vLLM's FP8 keeps them.
  What the format itself costs this model before any activation is rounded (an addition).
- ``bf16-rerounded``: the weights re-rounded at BF16's own step: an equally valid BF16 build, the
  control that must pass every rule.

Builds are written on demand and atomically: built in a temporary sibling directory, a marker naming the
recipe and a hash of the source weights written last, then renamed into place (``write_once``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_write_bytes, fsync_directory

if TYPE_CHECKING:
    import torch

__all__ = ["BF16_REROUNDED", "BUILDS", "E4M3", "E4M3_MAX", "MARKER", "Q8_0", "REFERENCE_BUILDS", "bf16_reround",
           "e4m3_per_channel_round_trip", "is_weight_matrix", "q8_0_round_trip", "write_build", "write_once",
           "write_rerounded", "write_transformed"]

MARKER = ".fp8gate-plant.json"  # the name earlier releases wrote, so their builds are still recognised
Q8_0 = "q8_0"
E4M3 = "e4m3"
BF16_REROUNDED = "bf16-rerounded"
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
_Q8_0_BLOCK = 32
# Names of the tensors vLLM's FP8 leaves in high precision: embeddings and the output head.
_NOT_LINEAR = ("embed", "lm_head", "wte", "wpe")


def is_weight_matrix(name: str, tensor: torch.Tensor) -> bool:
    """A floating tensor of two or more dimensions that is no norm's: what a weight rounding touches."""
    return tensor.is_floating_point() and tensor.dim() >= 2 and "norm" not in name.lower()


def _q8_0_roundable(name: str, tensor: torch.Tensor) -> bool:
    return is_weight_matrix(name, tensor) and tensor.shape[-1] % _Q8_0_BLOCK == 0


def _linear_weight(name: str, tensor: torch.Tensor) -> bool:
    return is_weight_matrix(name, tensor) and tensor.dim() == 2 and not any(part in name for part in _NOT_LINEAR)


def q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 of a weight tensor and back (``gguf.quants``, its numpy reference): blocks of 32
    along each row, one FP16 scale (absmax / 127) each, round to nearest; the result in the weight's
    dtype (one more rounding, to BF16, on top of Q8_0's)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rows = weight.to(torch.float32).numpy()
    blocks = quantize(np.ascontiguousarray(rows), GGMLQuantizationType.Q8_0)
    return torch.from_numpy(dequantize(blocks, GGMLQuantizationType.Q8_0).reshape(rows.shape)).to(weight.dtype)


def bf16_reround(seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """Stochastic re-rounding at BF16's step: each weight moves to its upper or lower BF16 neighbour
    with probability |u|, u ~ U(-1/2, 1/2): another rounding of the same underlying values, as an
    export from a higher-precision master with a different rounding would give."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def transform(weight: torch.Tensor) -> torch.Tensor:
        w = weight.to(torch.float32)
        ulp = torch.where(w != 0, torch.exp2(torch.floor(torch.log2(w.abs())) - 7), torch.zeros_like(w))
        u = torch.rand(w.shape, generator=generator) - 0.5
        moves = torch.rand(w.shape, generator=generator) < u.abs()
        return torch.where(moves, w + torch.sign(u) * ulp, w).to(weight.dtype)

    return transform


def e4m3_per_channel_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """``e4m3(W / s) * s`` with one scale per output channel (row), s = the row's absmax / 448, as a
    per-channel FP8 quantizer picks it; the result in the weight's dtype."""
    import torch

    w = weight.to(torch.float32)
    scale = w.abs().amax(dim=-1, keepdim=True) / E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row stays zero
    return ((w / scale).to(torch.float8_e4m3fn).to(torch.float32) * scale).to(weight.dtype)


def write_rerounded(seed: int, source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) the equally valid BF16 build: every weight matrix re-rounded at BF16's step."""
    return write_once({"kind": BF16_REROUNDED, "seed": seed},
                      functools.partial(write_transformed, bf16_reround(seed)), Path(source_dir), Path(out_dir))


def _write_q8_0(source_dir: Path, out_dir: Path) -> Path:
    write = functools.partial(write_transformed, q8_0_round_trip, selects=_q8_0_roundable)
    return write_once({"kind": Q8_0}, write, Path(source_dir), Path(out_dir))


def _write_e4m3(source_dir: Path, out_dir: Path) -> Path:
    write = functools.partial(write_transformed, e4m3_per_channel_round_trip, selects=_linear_weight)
    return write_once({"kind": E4M3}, write, Path(source_dir), Path(out_dir))


REROUNDED_SEED = 1  # the control's seed: the first of benchmarks/validity.py's re-rounded nulls
# The reference builds a thresholds file may name ([probabilities] references, [probabilities.limits] reference).
REFERENCE_BUILDS: dict[str, Callable[[Path, Path], Path]] = {Q8_0: _write_q8_0, E4M3: _write_e4m3}
# Every build the gate writes from the baseline's weights (`fp8gate build`).
BUILDS: dict[str, Callable[[Path, Path], Path]] = {
    **REFERENCE_BUILDS, BF16_REROUNDED: functools.partial(write_rerounded, REROUNDED_SEED)}


def write_build(kind: str, source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) the build ``kind`` of the checkpoint in ``source_dir`` at ``out_dir``."""
    if kind not in BUILDS:
        raise ValueError(f"unknown build {kind!r}; expected one of {', '.join(BUILDS)}")
    return BUILDS[kind](Path(source_dir), Path(out_dir))


def write_once(marker: dict, write: Callable[[Path, Path], None], source_dir: Path, out_dir: Path) -> Path:
    """``write(source_dir, temp)`` fills a fresh sibling directory, published under ``out_dir`` with the marker.

    An existing directory is reused only when its marker matches, replaced only when it holds a marker
    (a build written earlier) or nothing: never any other checkpoint, such as the source itself."""
    weights = sorted(source_dir.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{source_dir}: no *.safetensors weights to write a build from")
    marker = {**marker, "source_sha256": _content_hash(weights)}
    if _read_marker(out_dir) == marker:
        return out_dir
    _check_replaceable(out_dir)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = _sibling(out_dir, "tmp")
    temp.mkdir()  # unlike mkdtemp, honours the umask: the plant gets ordinary permissions
    try:
        write(source_dir, temp)
        (temp / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        _fsync_files(temp)  # the rename must not publish files still in the page cache only
        _move_into_place(temp, out_dir, marker)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out_dir


def _sibling(out_dir: Path, suffix: str) -> Path:
    # Same directory, so renames stay on one filesystem; hidden and unique per writer.
    return out_dir.with_name(f".{out_dir.name}.{uuid.uuid4().hex}.{suffix}")


def _content_hash(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


def _read_marker(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _check_replaceable(out_dir: Path) -> None:
    _check_writable_place(out_dir)
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise ValueError(f"{out_dir}: exists and is not a directory")
    if _read_marker(out_dir) is None and any(out_dir.iterdir()):
        raise ValueError(
            f"{out_dir}: not a checkpoint fp8gate wrote (no {MARKER} from an earlier fp8gate build); "
            "refusing to replace it, give a new directory"
        )


def _check_writable_place(out_dir: Path) -> None:
    """The plant is built in a sibling of ``out_dir`` and renamed onto it: both need a writable
    parent directory, and a mount point cannot be renamed."""
    how = "the plant is built next to it and renamed into place"
    if out_dir.is_dir() and os.path.ismount(out_dir):
        raise ValueError(f"{out_dir}: is a mount point, which cannot be replaced ({how}); "
                         f"give a directory inside it, e.g. {out_dir / 'plant'}")
    parent = next(p for p in out_dir.absolute().parents if p.exists())
    if os.statvfs(parent).f_flag & os.ST_RDONLY:
        raise ValueError(f"{out_dir}: {parent} is on a read-only filesystem ({how}); give a writable directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{out_dir}: {parent} is not writable ({how}); give a writable directory")


def write_transformed(transform: Callable[[torch.Tensor], torch.Tensor], source_dir: Path, out_dir: Path,
                      selects: Callable[[str, torch.Tensor], bool] = is_weight_matrix) -> None:
    """Copy the checkpoint in ``source_dir`` to the existing ``out_dir`` with ``transform`` applied
    to every tensor ``selects`` takes (by default every weight matrix, ``is_weight_matrix``)."""
    from safetensors import safe_open
    from safetensors.torch import save

    for path in sorted(source_dir.iterdir()):
        if not path.is_file() or path.name == MARKER:
            continue
        if path.suffix != ".safetensors":
            shutil.copy2(path, out_dir / path.name)  # configs, tokenizer, shard index
            continue
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
            tensors = {}
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                tensors[name] = transform(tensor) if selects(name, tensor) else tensor
        # safetensors' save_file creates 0600 files; these get the permissions the umask gives.
        atomic_write_bytes(out_dir / path.name, save(tensors, metadata=metadata))


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())


def _move_into_place(temp: Path, out_dir: Path, marker: dict) -> None:
    # A directory cannot be os.replace'd onto a non-empty one: move the stale
    # one aside first, so readers see either no directory or a complete one.
    if out_dir.exists():
        aside = _sibling(out_dir, "old")
        with contextlib.suppress(FileNotFoundError):  # a concurrent writer moved it already
            os.rename(out_dir, aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(temp, out_dir)
        fsync_directory(out_dir.parent)
    except OSError:
        # Another process placed its copy in the meantime; keep it if it is ours too.
        if _read_marker(out_dir) != marker:
            raise
