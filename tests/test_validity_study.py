"""The validity study's null builds and bound, without an engine."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import validity  # noqa: E402


def test_gaussian_noise_scales_with_the_matrix_rms():
    weight = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    noise = validity.gaussian(0.1)(weight) - weight
    assert float(noise.std()) == pytest.approx(0.1 * float(weight.pow(2).mean().sqrt()), rel=0.02)


def test_clopper_pearson_upper_bound():
    assert validity.upper_bound(0, 8) == pytest.approx(1 - 0.05 ** (1 / 8), abs=1e-9)
    assert validity.upper_bound(0, 32) < validity.upper_bound(1, 32) < validity.upper_bound(0, 8)
