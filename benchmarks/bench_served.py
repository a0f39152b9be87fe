"""The demo gate served (``fp8gate demo --serve``) against in-process, side by side in one run.

Prints each mode's wall time, their ratio and whether every rule's verdict and figure agree.
Run under the engine lock on CPU (both modes start their engines one at a time):

    flock /tmp/fp8gate-engine.lock python benchmarks/bench_served.py --questions 50
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _demo(workdir: Path, questions: int, serve: bool, select: str | None
          ) -> tuple[float, dict[str, tuple[str, float | None]]]:
    report = workdir / "report.json"
    command = [sys.executable, "-m", "pytest_fp8gate.tools.cli", "demo", "--workdir", str(workdir),
               "--questions", str(questions), *(["--serve"] if serve else []),
               "--", "--json-report", f"--json-report-file={report}", "-p", "no:randomly",
               *(["-k", select] if select else [])]
    started = time.perf_counter()
    subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=3600,
                   env=dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1"))
    elapsed = time.perf_counter() - started
    tests = json.loads(report.read_text())["tests"] if report.is_file() else []
    return elapsed, {t["nodeid"].split("::")[-1]: (t["outcome"], t.get("metadata", {}).get("fp8gate", {})
                                                  .get("measured")) for t in tests}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=50)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("-k", dest="select", default=None,
                        help="pytest -k for both modes; a deselected rule's measurement is not made "
                             "(-k 'not decode': the served engine has no decode phase yet)")
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="fp8gate-bench-served-"))
    local_s, local = _demo(root / "in-process", args.questions, False, args.select)
    served_s, served = _demo(root / "served", args.questions, True, args.select)
    same = [rule for rule in local if served.get(rule, ("", None))[0] == local[rule][0]]
    chosen = f" (-k {args.select!r})" if args.select else ""
    print(f"demo at {args.questions} questions{chosen}: in-process {local_s:.1f} s, served {served_s:.1f} s, "
          f"served / in-process = {served_s / local_s:.2f}")
    print(f"verdicts alike in {len(same)} of {len(local)} rule tests")
    for rule, (outcome, figure) in sorted(local.items()):
        other_outcome, other_figure = served.get(rule, ("missing", None))
        print(f"  {rule:<70} in-process {outcome:<7} {figure!s:<22} served {other_outcome:<7} {other_figure}")
    return 0 if len(same) == len(local) and local else 1


if __name__ == "__main__":
    raise SystemExit(main())
