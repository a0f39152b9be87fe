"""The demo gate with a cold baseline cache, then again with it warm, side by side.

One candidate (BF16 vs online fp8_per_channel, the demo config with its
batch-order and fp16 noise passes). The cold run measures the baseline and
stores it; the warm run restores it and starts only the candidate's engine.
Each run is a fresh `fp8gate demo` process with its own workdir, so nothing but
the cache carries over. Prints both wall times and warm/cold (acceptance: <= 0.5).
Usage:
  python benchmarks/bench_baseline_cache.py [WORKDIR]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENV = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
TARGET_RATIO = 0.5


def run_demo(workdir: Path, cache: Path) -> tuple[float, str]:
    """Wall time of one `fp8gate demo` run and its output; exits if the gate does not pass."""
    command = [sys.executable, "-m", "pytest_fp8gate.tools.cli", "demo", "--workdir", str(workdir),
               "--", "--fp8gate-baseline-cache", str(cache)]
    started = time.perf_counter()
    done = subprocess.run(command, env=ENV, capture_output=True, text=True)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} exited {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return elapsed, done.stdout


def engine_starts(output: str) -> list[str]:
    return re.findall(r"fp8gate: engine start: (\S+)", output)


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fp8gate-cache-bench-"))
    cache = root / "baseline-cache"
    cold_s, cold_out = run_demo(root / "cold", cache)
    warm_s, warm_out = run_demo(root / "warm", cache)
    ratio = warm_s / cold_s
    print(f"{'run':<6} {'wall s':>8}  engines started")
    print(f"{'cold':<6} {cold_s:>8.1f}  {', '.join(engine_starts(cold_out))}")
    print(f"{'warm':<6} {warm_s:>8.1f}  {', '.join(engine_starts(warm_out))}")
    print(f"warm / cold = {ratio:.3f} (acceptance: <= {TARGET_RATIO})")
    print(f"reports: {root / 'cold' / 'report.md'}, {root / 'warm' / 'report.md'}")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    raise SystemExit(main())
