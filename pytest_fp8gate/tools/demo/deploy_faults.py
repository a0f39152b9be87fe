"""Faults a deploy meets, written as checkpoints for the validity study to gate on a real model.

Unlike the plants (planting.py), which break every projection the same way, each fault here is one a
conversion or a serving config really makes:

- ``one-layer-unscaled``: one decoder layer's projections cast to E4M3 with no scale (scale 1, subnormals
  flushed), as when a converter skips one layer's calibration; every other layer is left exact.
- ``kv-overflow``: an FP8 KV cache with vLLM's default scale of 1.0 on a model whose keys and values
  exceed E4M3's range (448). The checkpoint is the baseline reparametrised exactly: keys and values are
  scaled up by a power of two and the query and output projections down by the same factor, so in BF16
  it computes what the baseline computes; only the FP8 cache, which the candidate's engine turns on,
  clips what it stores.
"""

from __future__ import annotations

import functools
import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...run.reference_builds import write_transformed
from .planting import Recipe, fp8_round_trip, is_projection

if TYPE_CHECKING:
    import torch

KV_SHIFT = 10  # keys and values x 2^10: a model whose K/V reach ~0.5 reaches E4M3's 448
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_UNSCALED = Recipe("E4M3 with no scale, subnormals flushed", stretch=None, restore_outlier=False,
                   flush_subnormals=True)


@dataclass(frozen=True)
class DeployFault:
    summary: str
    write: Callable[[Path, Path], None]  # (source checkpoint, existing empty output directory)
    engine: dict[str, Any] = field(default_factory=dict)  # the candidate engine's settings that expose it


def _num_layers(source_dir: Path) -> int:
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    return int(config.get("num_hidden_layers") or config["n_layer"])


def write_one_layer_unscaled(source_dir: Path, out_dir: Path) -> None:
    """The middle layer's projections through an unscaled E4M3 cast; everything else as it was."""
    middle = str(_num_layers(source_dir) // 2)

    def in_middle_layer(name: str, tensor: torch.Tensor) -> bool:
        layer = _LAYER.search(name)
        return is_projection(name, tensor) and layer is not None and layer.group(1) == middle

    write_transformed(functools.partial(fp8_round_trip, _UNSCALED), source_dir, out_dir, selects=in_middle_layer)


def _named(*projections: str) -> Callable[[str, torch.Tensor], bool]:
    pattern = re.compile(rf"\.({'|'.join(projections)})_proj\.(weight|bias)$")
    return lambda name, tensor: bool(pattern.search(name))


def write_kv_overflow(source_dir: Path, out_dir: Path, shift: int = KV_SHIFT) -> None:
    """k and v projections x 2^shift, q and o projections x 2^-shift (biases alike): exact in BF16, since a
    power of two only moves exponents, and q.k and o(softmax.v) are unchanged."""
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as scaled_up:
        write_transformed(lambda w: w * 2.0**shift, source_dir, Path(scaled_up), selects=_named("k", "v"))
        write_transformed(lambda w: w * 2.0**-shift, Path(scaled_up), out_dir, selects=_named("q", "o"))


DEPLOY_FAULTS: dict[str, DeployFault] = {
    "one-layer-unscaled": DeployFault("the middle layer's projections cast to E4M3 with scale 1",
                                      write_one_layer_unscaled),
    "kv-overflow": DeployFault(f"FP8 KV cache at scale 1.0, keys and values x 2^{KV_SHIFT} (an exact BF16 "
                               "reparametrisation) past E4M3's range", write_kv_overflow,
                               {"kv_cache_dtype": "fp8"}),
}
