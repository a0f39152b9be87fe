"""The validity study's null builds and bound, without an engine."""

from __future__ import annotations

import pytest

from pytest_fp8gate.core.bounds import upper_bound

torch = pytest.importorskip("torch")
from pytest_fp8gate.tools.demo.study_builds import gaussian  # noqa: E402


def test_gaussian_noise_scales_with_the_matrix_rms():
    weight = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    noise = gaussian(0.1)(weight) - weight
    assert float(noise.std()) == pytest.approx(0.1 * float(weight.pow(2).mean().sqrt()), rel=0.02)


def test_clopper_pearson_upper_bound():
    assert upper_bound(0, 8) == pytest.approx(1 - 0.05 ** (1 / 8), abs=1e-9)
    assert upper_bound(0, 32) < upper_bound(1, 32) < upper_bound(0, 8)
