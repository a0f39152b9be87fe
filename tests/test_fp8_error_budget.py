"""The FP8 error-budget benchmark's rounding and layer switching, on a toy module."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from pytest_fp8gate.tools.demo.fp8_emulation import Fp8Emulation, e4m3_round  # noqa: E402


def test_e4m3_rounding_keeps_each_rows_peak_and_three_mantissa_bits():
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, 64)[:, None]
    rounded = e4m3_round(weight, dim=1)
    peaks = weight.abs().argmax(dim=1)
    rows = torch.arange(64)
    assert torch.allclose(rounded[rows, peaks], weight[rows, peaks], rtol=1e-6)
    normal = weight.abs() > weight.abs().amax(dim=1, keepdim=True) * 2.0**-6 / 448 * 2
    relative = ((rounded - weight).abs() / weight.abs())[normal]
    assert float(relative.max()) <= 2.0**-4 + 1e-6  # half an E4M3 step
    assert float(relative.mean()) > 2.0**-8  # and it is FP8's step, not BF16's


class TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up_proj = torch.nn.Linear(32, 32, bias=False)
        self.down_proj = torch.nn.Linear(32, 32, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.up_proj(x))


def test_emulation_switches_only_the_chosen_layers_and_restores_them():
    torch.manual_seed(0)
    model = TwoLayers()
    x = torch.randn(4, 32)
    exact = model(x)
    emulation = Fp8Emulation(model)
    emulation.apply(["up_proj"], weights=True, inputs=False)
    assert not torch.equal(model.up_proj.weight, emulation.original["up_proj"])
    assert torch.equal(model.down_proj.weight, emulation.original["down_proj"])
    emulation.apply(["down_proj"], weights=False, inputs=True)
    assert torch.equal(model.up_proj.weight, emulation.original["up_proj"])
    assert not torch.allclose(model(x), exact, atol=1e-7)  # the input hook rounds down_proj's input
    emulation.apply([])
    assert torch.equal(model(x), exact)
