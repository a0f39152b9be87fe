"""What the installed plugin costs a pytest run that does not use the gate.

Runs a one-test project (no thresholds file) with the plugin and with
``-p no:fp8gate``, alternating, and measures each run's CPU time (user + system
of the child). Prints the median of the paired ratios, with / without; the goal
is <= 1.05. Pairing cancels drift from other load on the machine. Usage:
  python benchmarks/bench_plugin_startup.py [PAIRS]
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

GOAL = 1.05
WITH, WITHOUT = (), ("-p", "no:fp8gate")


def cpu_seconds(project: Path, extra: tuple[str, ...]) -> float:
    """CPU time of one `python -m pytest -q` in ``project``."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    process = subprocess.Popen(command, cwd=project, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"pytest {' '.join(extra)} exited {process.returncode}: {process.stderr.read().decode()}")
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    pairs = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        (project / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
        for extra in (WITH, WITHOUT):  # warm the file cache and the bytecode of both
            cpu_seconds(project, extra)
        runs = []
        for i in range(pairs):
            order = (WITH, WITHOUT) if i % 2 == 0 else (WITHOUT, WITH)  # neither always goes first
            times = {extra: cpu_seconds(project, extra) for extra in order}
            runs.append((times[WITH], times[WITHOUT]))
    ratio = statistics.median(w / wo for w, wo in runs)
    import pytest

    cached = "not written (PYTHONDONTWRITEBYTECODE)" if os.environ.get("PYTHONDONTWRITEBYTECODE") else "cached"
    print(f"pytest start, one test, no thresholds file: {pairs} pairs, CPU time per run (median)")
    print(f"  Python {sys.version.split()[0]}, pytest {pytest.__version__}, {os.cpu_count()} CPUs, bytecode {cached}")
    print(f"  with the plugin      {statistics.median(w for w, _ in runs):.3f} s")
    print(f"  with -p no:fp8gate   {statistics.median(wo for _, wo in runs):.3f} s")
    print(f"  paired ratio (median) {ratio:.3f}  (goal <= {GOAL}: {'met' if ratio <= GOAL else 'MISSED'})")


if __name__ == "__main__":
    main()
