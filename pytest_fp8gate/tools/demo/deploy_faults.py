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
- ``per-tensor-outliers``: per-tensor FP8 scales on a model with outlier channels. The checkpoint is the
  baseline reparametrised exactly (every 64th row of each MLP's up projection x 2^14, the same columns of
  its down projection x 2^-14), then every projection goes through E4M3 with one correct scale per tensor:
  the outlier rows set each up projection's scale, and the ordinary rows fall 2^14 lower, most of them
  into E4M3's subnormals. A per-channel scale would not lose them. E4M3's exponent absorbs smaller
  outliers: on the embedded model's up projections the ordinary rows' relative error is 0.027 at 2^0 to
  2^10, 0.030 at 2^12, 0.044 at 2^13, 0.085 at 2^14 and 0.34 at 2^16, against 0.026 per channel.
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
# Outlier channels x 2^14: only past about 2^12 do a per-tensor scale's ordinary weights reach E4M3's
# subnormals in numbers (max/median is about 8 on the embedded model): see the module's note.
OUTLIER_SHIFT = 14
OUTLIER_STRIDE = 64  # every 64th intermediate channel (12 of the embedded model's 768)
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_UNSCALED = Recipe("E4M3 with no scale, subnormals flushed", stretch=None, restore_outlier=False,
                   flush_subnormals=True)
PER_TENSOR = Recipe("E4M3 with one correct scale per tensor", stretch=1.0, restore_outlier=False)


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


def outlier_channels(weight: torch.Tensor, factor: float, dim: int) -> torch.Tensor:
    """``weight`` with every OUTLIER_STRIDE-th slice along ``dim`` (rows 0, or columns 1) times ``factor``."""
    scaled = weight.clone()
    index = (slice(None, None, OUTLIER_STRIDE), slice(None)) if dim == 0 else (slice(None), slice(None, None,
                                                                                                OUTLIER_STRIDE))
    scaled[index] = weight[index] * factor
    return scaled


def write_per_tensor_outliers(source_dir: Path, out_dir: Path, shift: int = OUTLIER_SHIFT) -> None:
    """Outlier channels planted exactly (up rows x 2^shift, the matching down columns x 2^-shift: the MLP's
    output is linear in the up projection), then every projection through a per-tensor E4M3 round trip."""
    with tempfile.TemporaryDirectory(dir=out_dir.parent) as up, tempfile.TemporaryDirectory(dir=out_dir.parent) as both:
        write_transformed(lambda w: outlier_channels(w, 2.0**shift, 0), source_dir, Path(up), selects=_named("up"))
        write_transformed(lambda w: outlier_channels(w, 2.0**-shift, 1), Path(up), Path(both),
                          selects=_named("down"))
        write_transformed(functools.partial(fp8_round_trip, PER_TENSOR), Path(both), out_dir, selects=is_projection)


DEPLOY_FAULTS: dict[str, DeployFault] = {
    "one-layer-unscaled": DeployFault("the middle layer's projections cast to E4M3 with scale 1",
                                      write_one_layer_unscaled),
    "kv-overflow": DeployFault(f"FP8 KV cache at scale 1.0, keys and values x 2^{KV_SHIFT} (an exact BF16 "
                               "reparametrisation) past E4M3's range", write_kv_overflow,
                               {"kv_cache_dtype": "fp8"}),
    "per-tensor-outliers": DeployFault(f"per-tensor E4M3 scales on a model with outlier channels (up rows x "
                                       f"2^{OUTLIER_SHIFT}, an exact BF16 reparametrisation)",
                                       write_per_tensor_outliers),
}
