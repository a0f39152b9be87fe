"""A managed ``vllm serve`` process: started by the gate, waited on until healthy, stopped.

The deploy's command line runs as given, in the gate's environment (the model's
``env`` applied, Engine.applied_env), plus the flags the gate controls
(``GATE_FLAGS``). The server gets its own process group, so stopping it
stops its engine core and workers too; it is registered with ``lifecycle``
(stopped on SIGTERM, SIGINT and exit; on SIGKILL of the gate, lifecycle's
watchdog stops it, its process group included, and it is in the pid file), and on
Linux the kernel also sends it SIGKILL when the gate dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..config.served import HOST
from ..errors import EndpointError
from . import lifecycle
from .http_client import EndpointClient

VLLM_CLI = (sys.executable, "-m", "pytest_fp8gate.engines.vllm_cli")  # `vllm` of the gate's own environment
STOP_GRACE_S = 15.0  # SIGTERM to SIGKILL of the server's process group
POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return int(probe.getsockname()[1])


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: lifecycle's handlers and pid file remain
        pass


class ManagedServer:
    """One running ``vllm serve``; ``stop()`` before the next starts."""

    def __init__(self, label: str, argv: Sequence[str], max_logprobs: int) -> None:
        """``argv``: the command after ``vllm`` (``serve MODEL ...``), without the gate's flags."""
        self.label = label
        self.port = free_port()
        self.url = f"http://{HOST}:{self.port}"
        self.argv = [*VLLM_CLI, *argv,
                     "--host", HOST, "--port", str(self.port), "--max-logprobs", str(max_logprobs)]
        self._log = tempfile.NamedTemporaryFile(prefix=f"fp8gate-{label}-", suffix=".log", delete=False)
        self.log_path = Path(self._log.name)
        before = lifecycle.starting(label)
        try:
            self.process = subprocess.Popen(
                self.argv, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, preexec_fn=_die_with_parent)
        except BaseException:
            lifecycle.abandon(label)
            self._log.close()
            self.log_path.unlink(missing_ok=True)
            raise
        self._tracked = lifecycle.track(label, lifecycle.child_pids() - before)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``/health`` answered 200; raises EndpointError (server stopped) if it never does."""
        client = EndpointClient(self.url)
        started = time.perf_counter()
        while True:
            code = self.process.poll()
            if code is not None:
                raise self._failed(f"exited with status {code} before it became healthy")
            try:
                client.get_text("/health", deadline_s=5.0)
                return time.perf_counter() - started
            except EndpointError:
                pass
            if time.perf_counter() - started > timeout_s:
                raise self._failed(f"not healthy after {timeout_s:g} s (health_timeout_s)")
            time.sleep(POLL_S)

    def _failed(self, what: str) -> EndpointError:
        tail = " | ".join(line.strip() for line in self.finish().splitlines()[-5:] if line.strip())
        return EndpointError(f"{self.label}: vllm serve {what}; last log lines: {tail or '(none)'}")

    def finish(self) -> str:
        """Stop the server, copy its log into the output of the rule test that started it (stderr), remove the
        log file (nothing is left in the temporary directory) and return the log's text."""
        self.stop()
        text = self.log_text()
        sys.stderr.write(f"--- vllm serve log of {self.label} ---\n{text}")
        self.log_path.unlink(missing_ok=True)
        return text

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        """Stop the whole process group (SIGTERM, then SIGKILL after STOP_GRACE_S), forget it."""
        if self.process.poll() is None:
            _signal_group(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.process.pid, signal.SIGKILL)  # whatever of the group outlived the server
        self.process.wait()
        lifecycle.release(self._tracked)
        self._log.close()


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass
