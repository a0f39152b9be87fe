"""Engines die with the gate: SIGTERM, SIGINT and exit stop them, the watchdog stops a SIGKILLed
gate's, and what a gate left behind when its watchdog died too is reported.

A plain child process (with a grandchild, as an engine core has workers) stands
in for an engine core, tracked the way ``Engine.__init__`` tracks a real one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import checkout_env
from pytest_fp8gate.engines import lifecycle

psutil = pytest.importorskip("psutil")

# The gate: starts a stand-in engine core (which starts a worker), tracks it, then
# exits at once ("exit"), or waits to be signalled ("wait").
GATE = """
import subprocess, sys, time
from pathlib import Path
from pytest_fp8gate.engines import lifecycle

lifecycle.watch(Path(sys.argv[1]))
before = lifecycle.starting("stand-in") if sys.argv[2] == "starting" else lifecycle.child_pids()
worker = "import time; time.sleep(600)"
core = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", core])
while len(lifecycle.child_pids() - before) < 2:  # the core and its worker
    time.sleep(0.05)
if sys.argv[2] == "starting":  # still inside vllm.LLM(...): nothing tracked yet
    print(*sorted(lifecycle.child_pids() - before), flush=True)
    time.sleep(600)
tracked = lifecycle.track("stand-in", lifecycle.child_pids() - before)
print(*(pid for pid, _ in tracked.processes), flush=True)
if sys.argv[2] == "wait":
    time.sleep(600)
"""


def _start(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, list[int]]:
    # This checkout's package, whatever the working directory (pytester changes it).
    env = checkout_env()
    gate = subprocess.Popen([sys.executable, "-c", GATE, str(tmp_path), mode], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert gate.stdout is not None
    pids = [int(pid) for pid in gate.stdout.readline().split()]
    if mode == "wait":  # the pid file lists them while the engine is up
        recorded = json.loads((tmp_path / lifecycle.PID_FILE).read_text())
        assert [pid for pid, _ in recorded["engines"][0]["processes"]] == pids
    return gate, pids


def _running(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _gone_within(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _running(pids)


def _kill(pids: list[int]) -> None:
    for pid in _running(pids):
        psutil.Process(pid).kill()


@pytest.mark.parametrize("signum, returncode", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, -signal.SIGINT)],
                         ids=["SIGTERM", "SIGINT"])
def test_a_signal_stops_the_engine_processes_then_takes_its_course(tmp_path: Path, signum, returncode) -> None:
    gate, pids = _start(tmp_path, "wait")
    try:
        assert len(pids) == 2 and _running(pids) == pids
        gate.send_signal(signum)
        # SIGTERM: its default action; SIGINT: Python's KeyboardInterrupt, which exits by SIGINT too.
        assert gate.wait(timeout=20) == returncode
        assert _gone_within(pids, 20), f"engine processes left: {_running(pids)}"
        assert not (tmp_path / lifecycle.PID_FILE).exists()
    finally:
        gate.kill()
        _kill(pids)


def test_a_signal_while_an_engine_starts_stops_what_the_start_spawned(tmp_path: Path) -> None:
    # A large model's engine start takes minutes; a cancelled job then must not orphan it.
    gate, pids = _start(tmp_path, "starting")
    try:
        assert len(pids) == 2 and _running(pids) == pids
        gate.send_signal(signal.SIGTERM)
        assert gate.wait(timeout=20) == -signal.SIGTERM
        assert _gone_within(pids, 20), f"engine processes left: {_running(pids)}"
    finally:
        gate.kill()
        _kill(pids)


def test_exit_without_shutdown_stops_the_engine_processes(tmp_path: Path) -> None:
    gate, pids = _start(tmp_path, "exit")
    try:
        assert len(pids) == 2
        assert gate.wait(timeout=20) == 0
        assert _gone_within(pids, 20), f"engine processes left: {_running(pids)}"
        assert not (tmp_path / lifecycle.PID_FILE).exists()
    finally:
        _kill(pids)


def _watchdog_of(gate: subprocess.Popen) -> psutil.Process:
    (watchdog,) = [child for child in psutil.Process(gate.pid).children()
                   if lifecycle.WATCHDOG_MARK in child.cmdline()]
    return watchdog


@pytest.mark.parametrize("mode", ["wait", "starting"])
def test_sigkill_of_the_gate_leaves_no_engine_process(tmp_path: Path, mode: str) -> None:
    gate, pids = _start(tmp_path, mode)
    try:
        assert len(pids) == 2 and _running(pids) == pids
        watchdog = _watchdog_of(gate)
        if mode == "starting":  # nothing tracked yet: only the watchdog's poll of the gate's children finds it
            time.sleep(2 * lifecycle.WATCH_INTERVAL_S)
        gate.kill()  # nothing of the gate's own runs after this
        gate.wait(timeout=20)
        assert _gone_within(pids, 20), f"engine processes left 20 s after SIGKILL: {_running(pids)}"
        assert _gone_within([watchdog.pid], 5), "the watchdog outlived its work"
    finally:
        _kill(pids)


def test_the_watchdog_leaves_a_gate_that_exits_normally(tmp_path: Path) -> None:
    gate, pids = _start(tmp_path, "wait")
    try:
        watchdog = _watchdog_of(gate)
        gate.terminate()
        gate.wait(timeout=20)
        assert _gone_within([watchdog.pid], 5)
    finally:
        _kill(pids)


def test_after_sigkill_the_next_run_reports_what_was_left(tmp_path: Path, pytester: pytest.Pytester) -> None:
    gate, pids = _start(tmp_path, "wait")
    try:
        _watchdog_of(gate).kill()  # the watchdog died first (an OOM kill, say): nothing stops the engine
        gate.kill()
        gate.wait(timeout=20)
        assert sorted(pid for pid, _ in lifecycle.stale_engines(tmp_path)) == sorted(pids)
        pytester.makepyfile("def test_x():\n    pass\n")
        result = pytester.runpytest("--fp8gate-artifacts", str(tmp_path))
        result.stdout.fnmatch_lines([
            f"fp8gate: WARNING: engine processes an earlier gate run left behind are still running "
            f"(from {tmp_path / lifecycle.PID_FILE}): *; stop them with: kill {' '.join(map(str, pids))}"])
        _kill(pids)
        assert _gone_within(pids, 20) and lifecycle.stale_engines(tmp_path) == []
    finally:
        _kill(pids)


def test_a_running_gate_is_not_reported_as_stale(tmp_path: Path) -> None:
    gate, pids = _start(tmp_path, "wait")
    try:
        assert lifecycle.stale_engines(tmp_path) == []
    finally:
        gate.terminate()
        gate.wait(timeout=20)
        _kill(pids)


def test_a_reused_pid_is_never_touched(tmp_path: Path) -> None:
    # A recorded pid whose create time differs is some other process now.
    me = psutil.Process()
    (tmp_path / lifecycle.PID_FILE).write_text(json.dumps({
        "gate": {"pid": 999999999, "create_time": 0.0},
        "engines": [{"label": "bf16", "processes": [[me.pid, me.create_time() - 100.0]]}]}))
    assert lifecycle.stale_engines(tmp_path) == []
