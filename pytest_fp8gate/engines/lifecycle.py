"""Engines die with the gate.

vLLM runs each engine core (and its workers) in child processes. A gate stopped
by SIGTERM (what ``timeout`` and a cancelled CI job send) or SIGINT would leave
them running, holding gigabytes of memory and, on a GPU runner, the GPU's. So
every engine's processes are tracked from its start to its shutdown: on
SIGTERM, SIGINT and at interpreter exit they are stopped, and then the signal
takes its course (SIGTERM its default action, SIGINT Python's KeyboardInterrupt).

SIGKILL cannot be caught (it is what a CI runner sends when a job's timeout or
cancel grace ends). So the first engine start also starts a watchdog: a small
separate process, in a session of its own so that a signal to the gate's process
group spares it, that polls the gate's pid and keeps a list of the processes the
gate has spawned since; when the gate is gone it stops them and their children
(SIGTERM, then SIGKILL after ``GRACE_S``) and exits. It also reads a registry file
the gate rewrites whenever it tracks or releases an engine, so that what the gate
tracked is stopped even before the first poll saw it, with the process groups
those processes lead (a managed ``vllm serve`` runs in a group of its own). A process spawned in the last
``WATCH_INTERVAL_S`` before the gate died is caught only through its parent.

Should the watchdog die too, while an engine is up its process ids are also in
``PID_FILE`` under the artifacts directory; a later run with the same
directory reports the processes a killed run left behind (``stale_engines``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text

PID_FILE = "fp8gate-engines.json"
GRACE_S = 5.0  # between SIGTERM and SIGKILL of an engine process
WATCH_INTERVAL_S = 0.5  # how often the watchdog looks at the gate
WATCHDOG_MARK = "fp8gate-watchdog"  # in the watchdog's command line
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# Helpers the first engine happens to start but the whole process shares (an in-process engine's
# torch compile pool too): the next engine would find them dead, and they exit with the process.
_SHARED_HELPERS = ("multiprocessing.resource_tracker", "multiprocessing.forkserver", "torch._inductor.compile_worker")


@dataclass(frozen=True)
class Tracked:
    """One engine's processes: (pid, create time) pairs, so a reused pid is never killed."""

    label: str
    processes: tuple[tuple[int, float], ...]
    groups: tuple[int, ...] = ()  # process groups its processes lead (a managed server's own), stopped too


_lock = threading.RLock()
_live: list[Tracked] = []
# label -> this process's children before that engine's start began: a signal during the
# start (minutes for a large model) stops whatever the start has spawned so far.
_starting: dict[str, set[int]] = {}
_pid_dir: Path | None = None
_previous_handlers: dict[int, Any] = {}
_installed = False
_watchdog: subprocess.Popen[bytes] | None = None
# What is tracked now, for the watchdog to read should this process die (it may not have polled yet).
_registry: Path | None = None

# The watchdog runs ``watchdog_main`` of this module with the gate's import path.
_WATCHDOG = "import sys; from pytest_fp8gate.engines.lifecycle import watchdog_main; watchdog_main(sys.argv[2:])"


def watch(directory: Path) -> None:
    """Keep the pid file of this process's engines in ``directory`` (the artifacts directory)."""
    global _pid_dir
    with _lock:
        _pid_dir = directory


def child_pids() -> set[int]:
    """This process's children, theirs included (the watchdog excepted)."""
    import psutil  # a declared dependency; only needed once engines run

    watchdog = _watchdog.pid if _watchdog is not None else None
    return {child.pid for child in psutil.Process().children(recursive=True) if child.pid != watchdog}


def _start_watchdog(since: float) -> None:
    """Once per process: the watchdog that stops what this process spawned from ``since`` (a create
    time) on, should this process die without a word."""
    global _watchdog, _registry
    if _watchdog is not None:
        return
    import psutil

    me = psutil.Process()
    handle, name = tempfile.mkstemp(prefix="fp8gate-tracked-", suffix=".json")
    os.close(handle)
    _registry = Path(name)
    argv = [sys.executable, "-c", _WATCHDOG, WATCHDOG_MARK, str(me.pid), repr(me.create_time()), repr(since), name]
    package_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    # No pipes of ours: a runner reading the gate's output must not wait for the watchdog's exit.
    _watchdog = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, env=env,
                                 stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)


def watchdog_main(argv: list[str]) -> None:
    """The watchdog (a process of its own): ``argv`` is the gate's pid, its create time, the
    earliest create time of what it stops and the gate's registry file. Polls the gate; once it is
    gone, stops what it spawned and what the registry lists, process groups included."""
    import psutil

    gate_pid, gate_created, since, registry = int(argv[0]), float(argv[1]), float(argv[2]), Path(argv[3])
    me = os.getpid()
    seen: dict[int, float] = {}
    while _alive(gate_pid, gate_created) is not None:
        try:
            for child in psutil.Process(gate_pid).children(recursive=True):
                if child.pid != me and child.pid not in seen and child.create_time() >= since:
                    seen[child.pid] = child.create_time()
        except psutil.Error:
            pass
        time.sleep(WATCH_INTERVAL_S)
    try:
        listed = [Tracked(e["label"], tuple((pid, created) for pid, created in e["processes"]), tuple(e["groups"]))
                  for e in json.loads(registry.read_text(encoding="utf-8") or "[]")]
    except (OSError, ValueError, KeyError, TypeError):
        listed = []
    registry.unlink(missing_ok=True)
    _stop([Tracked("left by a gate that died", tuple(seen.items())), *listed])


def starting(label: str) -> set[int]:
    """An engine is about to start: from now a signal also stops what its start spawns.
    Returns this process's children before the start, for ``track``."""
    with _lock:
        _start_watchdog(time.time() - 1.0)  # a second early: create times are rounded
        before = child_pids()
        _install_handlers()
        _starting[label] = before
    return before


def abandon(label: str) -> None:
    """The engine's start failed: nothing of it is left to track."""
    with _lock:
        _starting.pop(label, None)


def track(label: str, pids: set[int]) -> Tracked:
    """Stop these processes (an engine's, started since ``child_pids()`` was read) if the gate is stopped."""
    tracked = _tracked(label, pids)
    with _lock:
        _start_watchdog(min((created for _, created in tracked.processes), default=time.time()) - 1.0)
        _install_handlers()
        _starting.pop(label, None)
        _live.append(tracked)
        _write_pid_file()
    return tracked


def _tracked(label: str, pids: set[int]) -> Tracked:
    import psutil

    processes, groups = [], []
    for pid in sorted(pids):
        try:
            process = psutil.Process(pid)
            if not any(helper in " ".join(process.cmdline()) for helper in _SHARED_HELPERS):
                processes.append((pid, process.create_time()))
                if os.getpgid(pid) == pid:
                    groups.append(pid)
        except (psutil.Error, OSError):  # already gone
            continue
    return Tracked(label, tuple(processes), tuple(groups))


def release(tracked: Tracked) -> None:
    """After an engine's own shutdown: stop whatever of it is left, forget it."""
    _stop([tracked])
    with _lock:
        if tracked in _live:
            _live.remove(tracked)
        _write_pid_file()


def stop_all() -> None:
    """Stop every tracked engine's processes (at exit, or on a signal)."""
    with _lock:
        engines = list(_live)
        _live.clear()
        if _starting:
            now = child_pids()
            engines += [_tracked(label, now - before) for label, before in _starting.items()]
            _starting.clear()
        _write_pid_file()
    _stop(engines)


def stale_engines(directory: Path) -> list[tuple[int, str]]:
    """(pid, engine) of processes a gate that no longer runs left behind, from its pid file."""
    try:
        import psutil  # noqa: F401  (without it no engine ran, so none was left)
    except ImportError:
        return []
    try:
        recorded = json.loads((directory / PID_FILE).read_text(encoding="utf-8"))
        gate, engines = recorded["gate"], recorded["engines"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    if _alive(gate["pid"], gate["create_time"]) is not None:
        return []  # that gate is still running
    return [(pid, engine["label"]) for engine in engines for pid, created in engine["processes"]
            if _alive(pid, created) is not None]


def stale_warning(directory: Path) -> str | None:
    stale = stale_engines(directory)
    if not stale:
        return None
    listed = ", ".join(f"{pid} ({label})" for pid, label in stale)
    pids = " ".join(str(pid) for pid, _ in stale)
    return (f"fp8gate: WARNING: engine processes an earlier gate run left behind are still running "
            f"(from {directory / PID_FILE}): {listed}; stop them with: kill {pids}")


def _alive(pid: int, created: float) -> Any:
    """The psutil.Process, if the process recorded as (pid, create time) still runs."""
    import psutil

    try:
        process = psutil.Process(pid)
        if abs(process.create_time() - created) < 0.01 and process.status() != psutil.STATUS_ZOMBIE:
            return process
    except psutil.Error:
        pass
    return None


def _stop(engines: list[Tracked]) -> None:
    import psutil

    # A group's members outlive its leader (killed with the gate through PR_SET_PDEATHSIG, say),
    # so a group is stopped while its leader is alive or, leaderless, while it has members.
    groups = {group for engine in engines for group in engine.groups}
    _signal_groups(groups, signal.SIGTERM)
    processes = [p for engine in engines for pid, created in engine.processes if (p := _alive(pid, created))]
    for process in list(processes):
        try:
            processes += process.children(recursive=True)  # workers an engine core started later
        except psutil.Error:
            pass
    for process in processes:
        try:
            process.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(processes, timeout=GRACE_S)
    for process in alive:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=GRACE_S)
    _signal_groups(groups, signal.SIGKILL)


def _signal_groups(groups: set[int], signum: int) -> None:
    for group in groups:
        try:
            os.killpg(group, signum)
        except (ProcessLookupError, PermissionError):  # empty: Linux reuses no id of a live group
            pass


def _write_pid_file() -> None:
    if _registry is not None:
        atomic_write_text(_registry, json.dumps([{"label": engine.label, "groups": list(engine.groups),
                                                  "processes": [list(p) for p in engine.processes]}
                                                 for engine in _live]))
    if _pid_dir is None:
        return
    path = _pid_dir / PID_FILE
    if not _live:
        path.unlink(missing_ok=True)
        return
    import psutil

    me = psutil.Process()
    _pid_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({
        "gate": {"pid": me.pid, "create_time": me.create_time()},
        "engines": [{"label": engine.label, "processes": [list(p) for p in engine.processes]} for engine in _live],
    }, indent=1))


def _install_handlers() -> None:
    global _installed
    if _installed:
        return
    _installed = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():  # the only thread that may set handlers
        for signum in _SIGNALS:
            _previous_handlers[signum] = signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: Any) -> None:
    stop_all()
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)  # e.g. Python's SIGINT handler, which raises KeyboardInterrupt
        return
    if previous == signal.SIG_IGN:
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
