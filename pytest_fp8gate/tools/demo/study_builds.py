"""The validity study's weight transforms: Gaussian noise scaled to each matrix and the `mild` plant's
stretched per-tensor FP8 scale at a chosen stretch (benchmarks/validity.py writes builds with them)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .planting import Recipe, fp8_round_trip

if TYPE_CHECKING:
    import torch

__all__ = ["gaussian", "stretched"]


def gaussian(size: float, seed: int = 0) -> Callable[[torch.Tensor], torch.Tensor]:
    """Adds noise of standard deviation ``size`` x the matrix's RMS to each weight matrix."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def transform(weight: torch.Tensor) -> torch.Tensor:
        w = weight.to(torch.float32)
        rms = float(w.pow(2).mean().sqrt())
        return (w + size * rms * torch.randn(w.shape, generator=generator)).to(weight.dtype)

    return transform


def stretched(stretch: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-tensor E4M3 round trip whose scale an outlier stretched to ``stretch`` x the absmax."""
    recipe = Recipe(f"stretch {stretch:g}", stretch=stretch, restore_outlier=True)
    return lambda weight: fp8_round_trip(recipe, weight)
