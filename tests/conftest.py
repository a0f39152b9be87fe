from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from pytest_fp8gate import hardware

DATA = Path(__file__).parent / "data"


@pytest.fixture
def llama_config() -> Path:
    """Llama 3.1 8B Instruct's public config.json (no weights)."""
    return DATA / "llama-3.1-8b-instruct" / "config.json"


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Pretend these CUDA devices are visible, for in-process pytester runs."""

    def fake(*names: str) -> None:
        probe = hardware.CudaProbe(tuple(names), "faked by the test")
        monkeypatch.setattr(hardware, "probe_cuda", lambda: probe)

    return fake
