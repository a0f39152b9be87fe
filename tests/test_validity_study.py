"""The validity study's null builds and bound, without an engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import validity  # noqa: E402


def test_rerounding_moves_a_quarter_of_the_weights_by_one_bf16_step_at_most():
    weight = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    out = validity.rerounded(seed=1)(weight)
    assert out.dtype == torch.bfloat16
    w, o = weight.to(torch.float32), out.to(torch.float32)
    step = torch.exp2(torch.floor(torch.log2(w.abs())) - 7)
    assert bool(((o - w).abs() <= step * (1 + 1e-6)).all())
    assert 0.2 < float((o != w).float().mean()) < 0.3
    # Another seed is another equally valid build.
    assert not torch.equal(out, validity.rerounded(seed=2)(weight))


def test_gaussian_noise_scales_with_the_matrix_rms():
    weight = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    noise = validity.gaussian(0.1)(weight) - weight
    assert float(noise.std()) == pytest.approx(0.1 * float(weight.pow(2).mean().sqrt()), rel=0.02)


def test_clopper_pearson_upper_bound():
    assert validity.upper_bound(0, 8) == pytest.approx(1 - 0.05 ** (1 / 8), abs=1e-9)
    assert validity.upper_bound(0, 32) < validity.upper_bound(1, 32) < validity.upper_bound(0, 8)
