"""The repository's own test setup: pytester, and the fixtures the test files share.

Shared code that is not a fixture (thresholds text, the fake engine, recorded
measurements) lives in tests/fakes.py, which the test files import.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest

from pytest_fp8gate import hardware

pytest_plugins = ["pytester"]

DATA = Path(__file__).parent / "tests" / "data"


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


def _write_checkpoint(directory: Path, vocab_size: int = 32) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": vocab_size}))
    header = json.dumps({"lm_head.weight": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    return directory


@pytest.fixture
def make_checkpoint() -> Callable[..., Path]:
    """Writes a minimal checkpoint the config checks accept: config.json and one 2x2 BF16 safetensors tensor."""
    return _write_checkpoint
