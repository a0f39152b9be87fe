"""The repository's own test setup: hermetic pytester runs, and the fixtures the test files share.

Shared code that is not a fixture (thresholds text, the fake engine, recorded
measurements) lives in tests/fakes.py, which the test files import.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import pytest

# The gate's pytest side loaded once in this outer process: pytester's in-process runs unload every module
# first imported inside them, so a module imported afresh by a later run would hold other classes and stash
# keys (collect's ThresholdsFile, session's STATE_KEY) than the modules an earlier test kept.
import pytest_fp8gate.face.collect  # noqa: F401
import pytest_fp8gate.face.refusals  # noqa: F401
import pytest_fp8gate.face.report_hooks  # noqa: F401
import pytest_fp8gate.face.selection  # noqa: F401
import pytest_fp8gate.face.session  # noqa: F401
import pytest_fp8gate.face.suite  # noqa: F401
from pytest_fp8gate import hardware

pytest_plugins = ["pytester"]

DATA = Path(__file__).parent / "tests" / "data"
# What every inner pytest run loads: the gate, by its entry point's name. Other plugins a test
# means to test it names itself (`-p pytest_jsonreport`, `-p xdist`).
INNER_PLUGINS = "-p fp8gate"


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester whose runs, inline or in a subprocess, load the gate and the plugins a test names, not
    every installed one: pytest-randomly would reseed and reorder them, pytest-xdist add its options."""
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    # pytester clears PYTEST_ADDOPTS when it starts; set after that, it reaches every run of this test.
    monkeypatch.setenv("PYTEST_ADDOPTS", INNER_PLUGINS)
    return pytester


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # On pytest-xdist's workers (scripts/test, --dist loadgroup) a test file runs on one worker, so its
    # module-scoped fixtures (written checkpoints, judged fake gates) are built once; the engine tests,
    # each taking the whole machine, share one worker and run one at a time.
    for item in items:
        group = "engine" if item.get_closest_marker("engine") else item.path.name
        item.add_marker(pytest.mark.xdist_group(group))
