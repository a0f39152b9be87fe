"""vLLM's online ``fp8_per_channel`` (W8A8) emulated in torch, layer by layer (benchmarks/fp8_error_budget.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ...run.reference_builds import E4M3_MAX

if TYPE_CHECKING:
    import torch

__all__ = ["PROJECTION", "Fp8Emulation", "e4m3_round"]

PROJECTION = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def e4m3_round(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """Symmetric E4M3 rounding with one absmax scale per slice along ``dim`` (rows or tokens)."""
    import torch

    scale = tensor.abs().amax(dim=dim, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (tensor / scale).to(torch.float8_e4m3fn).to(tensor.dtype) * scale


class Fp8Emulation:
    """Switches chosen linear layers of a loaded model between BF16 and emulated FP8."""

    def __init__(self, model: torch.nn.Module) -> None:
        import torch

        self.layers = {name: module for name, module in model.named_modules()
                       if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in PROJECTION}
        self.original = {name: module.weight.data.clone() for name, module in self.layers.items()}
        self.hooks: list[torch.utils.hooks.RemovableHandle] = []

    def apply(self, names: Iterable[str], weights: bool = True, inputs: bool = True) -> None:
        for handle in self.hooks:
            handle.remove()
        self.hooks.clear()
        chosen = set(names)
        for name, module in self.layers.items():
            weight = self.original[name]
            module.weight.data = e4m3_round(weight, dim=1) if name in chosen and weights else weight
            if name in chosen and inputs:
                self.hooks.append(module.register_forward_pre_hook(lambda _, args: (e4m3_round(args[0], -1),)))
