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

import functools
import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...run.reference_builds import E4M3_MAX, MARKER, write_once, write_transformed
from .sink_plant import RECIPE as SINK_RECIPE
from .sink_plant import SUMMARY as SINK_SUMMARY
from .sink_plant import write_evicted_sink

if TYPE_CHECKING:
    import torch

__all__ = ["EVICTED_SINK", "PLANT_KINDS", "Q8_0_ROUND_TRIP", "WRONG_EOS", "Recipe", "fp8_round_trip", "is_projection",
           "plant", "write_wrong_eos"]

Q8_0_ROUND_TRIP = "q8_0-roundtrip"  # the demo's candidate name for llama.cpp's Q8_0 rounding stored as BF16
E4M3_MIN_NORMAL = 2.0**-6  # smallest normal float8_e4m3fn magnitude
_LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")


def is_projection(name: str, tensor: torch.Tensor) -> bool:
    """The q/k/v/o/gate/up/down projections a plant's broken conversion touches, as vLLM's FP8 would."""
    return bool(_LINEAR.search(name))


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


def plant(name: str, source_dir: Path, out_dir: Path) -> Path:
    """Write (or reuse) the planted regression ``name`` (a key of ``PLANT_KINDS``) of the checkpoint
    in ``source_dir``.

    Returns ``out_dir``. Raises ValueError for an unknown kind, a source without
    safetensors weights, or an ``out_dir`` that is neither empty nor an earlier
    plant (so a mistyped path never replaces a real checkpoint or unrelated data).
    """
    if name == EVICTED_SINK:
        return write_once({"kind": name, "recipe": SINK_RECIPE}, write_evicted_sink, Path(source_dir), Path(out_dir))
    if name == WRONG_EOS:
        return write_once({"kind": name}, write_wrong_eos, Path(source_dir), Path(out_dir))
    if name not in _RECIPES:
        raise ValueError(f"unknown plant kind {name!r}; valid kinds: {', '.join(PLANT_KINDS)}")
    recipe = _RECIPES[name]
    return write_once({"kind": name, "recipe": asdict(recipe)},
                      functools.partial(write_transformed, functools.partial(fp8_round_trip, recipe),
                                        selects=is_projection), Path(source_dir), Path(out_dir))


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


