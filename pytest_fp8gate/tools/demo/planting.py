"""Planted regressions: BF16 checkpoints whose linear weights went through a broken FP8 round trip.

A plant is what a faulty FP8 conversion would serve, written back as an
ordinary BF16 checkpoint so any engine loads it without quantization support.
Like vLLM's online quantization, only the q/k/v/o/gate/up/down projections are
touched; embeddings, norms and lm_head stay as they were. Each weight matrix W
becomes ``e4m3(W / s) * s`` for a per-tensor scale ``s`` that is wrong on
purpose (see ``PLANT_KINDS``). One kind is no FP8 fault but a regression only the
decode phase can see: ``evicted-sink`` (sink_plant.py) adds a layer and a sliding
window that change nothing before position 2,000. Another, ``wrong-eos``, keeps every weight
and breaks the end-of-sequence setup (write_wrong_eos), a fault of exported checkpoints.

Plants are written on demand and atomically: the checkpoint is built in a
temporary sibling directory, a marker naming the recipe and a hash of the
source weights is written last, and the directory is renamed into place. An
existing directory is reused only when its marker matches, replaced only when
it holds a marker (a plant written earlier) or nothing: never any other
checkpoint, such as the source itself.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ...atomic import atomic_write_bytes, fsync_directory
from .sink_plant import RECIPE as SINK_RECIPE
from .sink_plant import SUMMARY as SINK_SUMMARY
from .sink_plant import write_evicted_sink

if TYPE_CHECKING:
    import torch

__all__ = ["EVICTED_SINK", "MARKER", "PLANT_KINDS", "Q8_0_ROUND_TRIP", "REROUNDED", "WRONG_EOS", "Recipe",
           "bf16_reround", "fp8_round_trip", "plant", "q8_0_round_trip", "write_q8_0_round_trip", "write_rerounded",
           "write_transformed", "write_wrong_eos"]

MARKER = ".fp8gate-plant.json"
REROUNDED = "bf16-rerounded"  # the equally valid BF16 build (write_rerounded), not a plant
Q8_0_ROUND_TRIP = "q8_0-roundtrip"  # llama.cpp's Q8_0 rounding stored as BF16 (write_q8_0_round_trip)
E4M3_MAX = 448.0  # largest finite float8_e4m3fn value
E4M3_MIN_NORMAL = 2.0**-6  # smallest normal float8_e4m3fn magnitude
_LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
_Q8_0_ROUNDED = re.compile(_LINEAR.pattern + r"|^model\.embed_tokens\.weight$")


@dataclass(frozen=True)
class Recipe:
    summary: str
    # None: no scale at all (s = 1). Otherwise s = stretch * absmax / 448, i.e.
    # the scale a per-tensor quantizer picks when one weight is `stretch` times
    # the matrix's absmax; stretch = 1 is a correct per-tensor scale.
    stretch: float | None
    # The stretching weight is the matrix's largest one; its original value is
    # put back after the round trip, so only the other weights' precision loss
    # remains (an outlier kept in high precision, as outlier-aware schemes do).
    restore_outlier: bool
    # Flush E4M3 subnormals (magnitudes under 2^-6) to zero, as fast-math conversions do.
    flush_subnormals: bool = False


_RECIPES: dict[str, Recipe] = {
    "noscale": Recipe(
        "E4M3 cast with no scale (scale 1) through a conversion that flushes subnormals to "
        "zero: every weight under 2^-6 (about 0.0156) becomes 0, the article's underflow "
        "at its worst; trips KL, RMS dp, accuracy and flips",
        stretch=None,
        restore_outlier=False,
        flush_subnormals=True,
    ),
    "outlier": Recipe(
        "per-tensor E4M3 whose scale one corrupt outlier stretched to 1e5 x each matrix's "
        "absmax (outlier restored afterwards): nearly all weights fall to the subnormal "
        "grid or zero; trips every probability, accuracy and flip rule",
        stretch=100000.0,
        restore_outlier=True,
    ),
    "mild": Recipe(
        "per-tensor E4M3 whose scale an outlier stretched to 2e4 x the absmax (outlier "
        "restored): the smaller weights lose precision; meant to trip only the flip rule "
        "(the most sensitive on the embedded model) while accuracy and every probability "
        "figure stay inside their limits: answers change underneath a flat score",
        stretch=20000.0,
        restore_outlier=True,
    ),
}

EVICTED_SINK = "evicted-sink"  # sink_plant.py: a regression only positions past the probability chunks reach
WRONG_EOS = "wrong-eos"  # write_wrong_eos: the weights untouched, the answers no longer end
_WRONG_EOS_SUMMARY = (
    "the weights untouched, but the export names the pad token as end of sequence (tokenizer_config.json's "
    "eos_token, generation_config.json's and config.json's eos_token_id): the engine no longer stops at the "
    "EOS the model writes and answers run to the token budget; trips truncation on a task whose only stop "
    "is EOS (think_end)")
PLANT_KINDS: dict[str, str] = {**{kind: recipe.summary for kind, recipe in _RECIPES.items()},
                               EVICTED_SINK: SINK_SUMMARY, WRONG_EOS: _WRONG_EOS_SUMMARY}


def plant(kind: str, source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) the planted regression ``kind`` of the checkpoint in ``source_dir``.

    Returns ``out_dir``. Raises ValueError for an unknown kind, a source without
    safetensors weights, or an ``out_dir`` that is neither empty nor an earlier
    plant (so a mistyped path never replaces a real checkpoint or unrelated data).
    """
    if kind == EVICTED_SINK:
        return _write_once({"kind": kind, "recipe": SINK_RECIPE}, write_evicted_sink, Path(source_dir), Path(out_dir))
    if kind == WRONG_EOS:
        return _write_once({"kind": kind}, write_wrong_eos, Path(source_dir), Path(out_dir))
    if kind not in _RECIPES:
        raise ValueError(f"unknown plant kind {kind!r}; valid kinds: {', '.join(PLANT_KINDS)}")
    recipe = _RECIPES[kind]
    return _write_once({"kind": kind, "recipe": asdict(recipe)},
                       functools.partial(write_transformed, functools.partial(fp8_round_trip, recipe)),
                       Path(source_dir), Path(out_dir))


def write_rerounded(seed: int, source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) an equally valid BF16 build: the linear weights re-rounded at BF16's own step.

    Not a regression: the control the demo and ``benchmarks/validity.py`` judge
    next to the FP8 builds, so a reader sees what a build that must pass scores.
    Same atomic, marker-checked writing as ``plant``.
    """
    return _write_once({"kind": REROUNDED, "seed": seed}, functools.partial(write_transformed, bf16_reround(seed)),
                       Path(source_dir), Path(out_dir))


def write_q8_0_round_trip(source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) the Q8_0 round trip: every projection weight and the token embedding through
    llama.cpp's Q8_0 rounding (``q8_0_round_trip``), stored as BF16. These are the matrices
    llama-quantize rounds for Q8_0, so this is the build whose llama.cpp row the default limits borrow.
    Same atomic, marker-checked writing as ``plant``."""
    write = functools.partial(write_transformed, q8_0_round_trip, names=_Q8_0_ROUNDED)
    return _write_once({"kind": Q8_0_ROUND_TRIP}, write, Path(source_dir), Path(out_dir))


def q8_0_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """llama.cpp's Q8_0 of a weight matrix and back (``gguf.quants``, its numpy reference): blocks of 32
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


def _write_once(marker: dict, write: Callable[[Path, Path], None], source_dir: Path, out_dir: Path) -> Path:
    """``write(source_dir, temp)`` fills a fresh sibling directory, published under ``out_dir`` with the marker."""
    weights = sorted(source_dir.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"{source_dir}: no *.safetensors weights to plant from")
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
            f"{out_dir}: not a planted checkpoint (no {MARKER} from an earlier fp8gate plant); "
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
                      names: re.Pattern[str] = _LINEAR) -> None:
    """Copy the checkpoint in ``source_dir`` to the existing ``out_dir`` with ``transform`` applied
    to every tensor whose name ``names`` finds (by default the q/k/v/o/gate/up/down projections)."""
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
            tensors = {
                name: transform(handle.get_tensor(name)) if names.search(name)
                else handle.get_tensor(name)
                for name in handle.keys()
            }
        # safetensors' save_file creates 0600 files; these get the permissions the umask gives.
        atomic_write_bytes(out_dir / path.name, save(tensors, metadata=metadata))


def write_wrong_eos(source_dir: Path, out_dir: Path) -> None:
    """Copy the checkpoint with its pad token named as EOS wherever the export states EOS. vLLM stops at
    the tokenizer's eos_token_id and generation_config.json's eos_token_id
    (SamplingParams.update_from_generation_config); both now name the pad token, which the model never
    writes, so its own EOS (still a special token, skipped in the text) ends nothing."""
    tokenizer = json.loads((source_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    pad = tokenizer.get("pad_token")
    generation = json.loads((source_dir / "generation_config.json").read_text(encoding="utf-8"))
    pad_id = generation.get("pad_token_id")
    if pad is None or pad_id is None or pad == tokenizer.get("eos_token"):
        raise ValueError(f"{source_dir}: needs a pad token apart from EOS (tokenizer_config.json's pad_token, "
                         "generation_config.json's pad_token_id) to name as EOS")
    edits = {"tokenizer_config.json": {"eos_token": pad}, "generation_config.json": {"eos_token_id": pad_id},
             "config.json": {"eos_token_id": pad_id}}
    for path in sorted(source_dir.iterdir()):
        if path.is_file() and path.name != MARKER:
            shutil.copy2(path, out_dir / path.name)
    for name, edit in edits.items():
        settings = json.loads((out_dir / name).read_text(encoding="utf-8"))
        (out_dir / name).write_text(json.dumps({**settings, **edit}, indent=2) + "\n", encoding="utf-8")


def fp8_round_trip(recipe: Recipe, weight: torch.Tensor) -> torch.Tensor:
    """``e4m3(W / s) * s`` with the recipe's (wrong) per-tensor scale s, in the weight's dtype."""
    import torch

    w = weight.to(torch.float32)
    flat_peak = int(w.abs().argmax())
    scale = 1.0 if recipe.stretch is None else recipe.stretch * float(w.abs().max()) / E4M3_MAX
    scaled = (w / scale).clamp(-E4M3_MAX, E4M3_MAX)
    fp8 = scaled.to(torch.float8_e4m3fn).to(torch.float32)
    if recipe.flush_subnormals:
        fp8 = torch.where(fp8.abs() < E4M3_MIN_NORMAL, torch.zeros_like(fp8), fp8)
    out = fp8 * scale
    if recipe.restore_outlier:
        out.view(-1)[flat_peak] = w.view(-1)[flat_peak]
    return out.to(weight.dtype)


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
