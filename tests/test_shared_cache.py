"""Gates that share one baseline cache directory, each a pytest process over the fake engine: one measures the
entry while the other waits and restores it, a killed measuring gate leaves the waiting one to measure afresh,
and a gate told not to wait measures its own. The fake baseline engine pauses in its first pass until the test
releases it, so that the second gate meets the lock held."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fakes import checkout_env, write_gate
from pytest_fp8gate.run.baseline_cache import verify

CONFTEST = """
import os
import time
from pathlib import Path

import pytest

from fakes import MODELS, fake_engine_class
from pytest_fp8gate import hardware

HERE = Path(__file__).parent
# No GPU here, as the probe finds on a host without nvidia-smi, but without importing torch for it: seconds of
# CPU in each gate this test starts.
hardware.probe_cuda = lambda: hardware.CudaProbe((), "faked by the test")


class Paused(fake_engine_class(MODELS)):
    def prompt_logprobs(self, *args, **kwargs):
        if os.environ.get("FP8GATE_TEST_PAUSE") and self.spec.name == "bf16" and not (HERE / "release").exists():
            (HERE / f"measuring-{os.getpid()}").touch()
            while not (HERE / "release").exists():
                time.sleep(0.05)
        return super().prompt_logprobs(*args, **kwargs)


def pytest_fp8gate_engine_class():
    return Paused
"""
WAIT_S = 60.0


STARTED: list[subprocess.Popen] = []


@pytest.fixture
def workdir(tmp_path: Path):
    write_gate(tmp_path, task=False)  # 5 rules a candidate: "good" passes them, "bad" fails them
    (tmp_path / "conftest.py").write_text(CONFTEST)
    yield tmp_path
    while STARTED:  # a gate a failed assertion left paused
        gate = STARTED.pop()
        if gate.poll() is None:
            gate.kill()
            gate.wait()


def start(workdir: Path, label: str, *args: str, pause: bool = True) -> subprocess.Popen:
    """A gate in its own process; ``pause``: its baseline engine waits in its first pass for the test's release."""
    env = checkout_env()
    tests = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])  # the conftest imports fakes
    env = dict(env, PYTHONPATH=tests, PYTEST_DISABLE_PLUGIN_AUTOLOAD="1", PYTEST_ADDOPTS="", PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", FP8GATE_TEST_PAUSE="1" if pause else "")
    with open(workdir / f"{label}.txt", "w") as output:  # a file, not a pipe: the gates run at once
        STARTED.append(subprocess.Popen([sys.executable, "-m", "pytest", "thresholds.toml", "-p", "fp8gate", "-p",
                                 "no:cacheprovider", "-rs", "--fp8gate-baseline-cache", "cache",
                                 "--fp8gate-artifacts", f"artifacts-{label}", *args],
                                        cwd=workdir, stdout=output, stderr=subprocess.STDOUT, text=True, env=env))
    return STARTED[-1]


def output(workdir: Path, label: str) -> str:
    return (workdir / f"{label}.txt").read_text()


def wait_for(what: str, condition, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {timeout_s:g} s"
        time.sleep(0.1)


def measuring(workdir: Path, gate: subprocess.Popen) -> bool:
    return (workdir / f"measuring-{gate.pid}").exists()


def finish(workdir: Path, label: str, gate: subprocess.Popen, timeout_s: float = 120) -> dict[str, int]:
    gate.wait(timeout=timeout_s)
    text = output(workdir, label)
    outcomes = pytest.RunResult(gate.returncode, text.splitlines(), [], 0.0).parseoutcomes()
    return {name: count for name, count in outcomes.items() if name not in ("warning", "warnings")}


def baseline_starts(text: str) -> int:
    return len(re.findall(r"^fp8gate: engine start: bf16 \(", text, re.MULTILINE))


def whole_entry(cache: Path) -> Path:
    (entry,) = cache.glob("bf16-*/")  # beside it: vLLM's compile cache, vllm-cache
    verify(entry, json.loads((entry / "key.json").read_text()))
    assert not [p.name for p in cache.iterdir() if p.name.startswith((".staging", ".trash"))]
    return entry


def test_two_gates_at_once_measure_the_baseline_once_and_judge_their_own_candidate(workdir: Path):
    gates = {"good": start(workdir, "good", "--fp8gate-candidate", "good"),
             "bad": start(workdir, "bad", "--fp8gate-candidate", "bad")}
    wait_for("a gate measuring the baseline", lambda: any(measuring(workdir, g) for g in gates.values()))
    first = next(label for label, g in gates.items() if measuring(workdir, g))
    second = "bad" if first == "good" else "good"
    wait_for(f"{second} to wait for the lock", lambda: "fp8gate: waiting for bf16-" in output(workdir, second))
    (workdir / "release").touch()
    outcomes = {label: finish(workdir, label, gate) for label, gate in gates.items()}
    assert outcomes == {"good": {"passed": 5}, "bad": {"failed": 5}}, {k: output(workdir, k)[-3000:] for k in gates}
    assert [baseline_starts(output(workdir, label)) for label in (first, second)] == [1, 0]
    waited = output(workdir, second)
    assert re.search(r"^fp8gate: waited \d+\.\d s for pid \d+, which was measuring this baseline \(bf16-\w+\.lock\)$",
                     waited, re.MULTILINE), waited
    assert "fp8gate: baseline bf16 from the cache" in waited
    whole_entry(workdir / "cache")


def test_a_killed_measuring_gate_leaves_the_waiting_one_to_measure_afresh(workdir: Path):
    killed = start(workdir, "killed", "--fp8gate-candidate", "good")
    wait_for("the first gate to measure the baseline", lambda: measuring(workdir, killed))
    waiting = start(workdir, "waiting", "--fp8gate-candidate", "bad", pause=False)
    wait_for("the second gate to wait", lambda: "fp8gate: waiting for bf16-" in output(workdir, "waiting"))
    os.kill(killed.pid, signal.SIGKILL)  # midway through the baseline's first pass, holding the lock
    killed.wait(timeout=30)
    assert finish(workdir, "waiting", waiting) == {"failed": 5}, output(workdir, "waiting")[-3000:]
    text = output(workdir, "waiting")
    assert "which was measuring this baseline" in text and baseline_starts(text) == 1
    assert re.search(rf"^fp8gate: baseline cache miss for bf16 \(no entry for this key; pid {killed.pid} ended "
                     r"without storing it\); measuring$", text, re.MULTILINE), text
    whole_entry(workdir / "cache")


def test_a_gate_told_not_to_wait_measures_its_own_and_leaves_the_entry_to_the_other(workdir: Path):
    storing = start(workdir, "storing", "--fp8gate-candidate", "good")
    wait_for("the first gate to measure the baseline", lambda: measuring(workdir, storing))
    own = start(workdir, "own", "--fp8gate-candidate", "good", "--fp8gate-cache-wait", "0", pause=False)
    assert finish(workdir, "own", own) == {"passed": 5}, output(workdir, "own")[-3000:]
    text = output(workdir, "own")
    assert baseline_starts(text) == 1 and "waiting for" not in text
    assert re.search(r"^fp8gate: bf16-\w+\.lock is held by another run measuring this baseline; "
                     r"--fp8gate-cache-wait 0: measuring this run's own, which that run stores$", text, re.MULTILINE)
    assert not [p for p in (workdir / "cache").iterdir() if p.is_dir() and p.name.startswith("bf16-")]
    (workdir / "release").touch()
    assert finish(workdir, "storing", storing) == {"passed": 5}
    whole_entry(workdir / "cache")


@pytest.mark.parametrize("value", ["-1", "soon", "inf"])
def test_a_cache_wait_that_is_not_seconds_is_a_usage_error(pytester: pytest.Pytester, value: str):
    write_gate(pytester.path, task=False)
    result = pytester.runpytest("thresholds.toml", f"--fp8gate-cache-wait={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --fp8gate-cache-wait {value}: expected a number of seconds "
                                 "of 0 or more (0: do not wait)"])
