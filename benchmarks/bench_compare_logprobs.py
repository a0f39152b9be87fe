"""Time compare_logprobs on 1,000,000 positions x top-20 against a plain Python loop.

Run: python benchmarks/bench_compare_logprobs.py [--positions N] [--seed S]

The data is synthetic but shaped like two vLLM prompt_logprobs passes: each
position has a small pool of plausible tokens; the candidate sees the
baseline's logits plus noise, so its top-20 reorders and sometimes drops a
baseline id, which exercises the id matching behind the top-k KL bound.
The Python loop runs on a subsample and is scaled linearly (it is O(N)).
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

from pytest_fp8gate.core.logprobs import LogprobRun, compare_logprobs

K = 20
POOL = 24  # plausible tokens per position; 4 of them fall outside each top-20
VOCAB = 128_256
TAIL_LOGIT = 1.0  # the rest of the vocabulary, lumped into one logit


def synthetic_pair(n: int, seed: int) -> tuple[LogprobRun, LogprobRun]:
    rng = np.random.default_rng(seed)
    pool_ids = (rng.integers(0, VOCAB, (n, 1)) + 5_003 * np.arange(POOL)) % VOCAB
    real_column = rng.integers(0, POOL, n)
    logits = rng.normal(scale=2.5, size=(n, POOL))

    def run(model_logits: np.ndarray) -> LogprobRun:
        norm = np.logaddexp(np.log(np.exp(model_logits).sum(axis=1)), TAIL_LOGIT)
        logprobs = model_logits - norm[:, None]
        order = np.argsort(-logprobs, axis=1)[:, :K]
        return LogprobRun(
            real_logprob=logprobs[np.arange(n), real_column],
            top_ids=np.take_along_axis(pool_ids, order, axis=1),
            top_logprobs=np.take_along_axis(logprobs, order, axis=1),
        )

    return run(logits), run(logits + rng.normal(scale=0.05, size=logits.shape))


def as_lists(run: LogprobRun, n: int) -> tuple[list, list, list]:
    return run.real_logprob[:n].tolist(), run.top_ids[:n].tolist(), run.top_logprobs[:n].tolist()


def python_loop(base: tuple[list, list, list], cand: tuple[list, list, list]) -> dict[str, float]:
    """The same numbers, one position at a time, on plain lists and dicts."""
    same = sq_dp = sum_dp = ln_ratio = kl_sum = 0.0
    floor = (K + 1) * 2.220446049250313e-16
    rounding = 1e-5  # logprobs._REPORTED_ROUNDING
    for b_real, b_ids, b_lp, c_real, c_ids, c_lp in zip(*base, *cand):
        same += b_ids[0] == c_ids[0]
        dp = math.exp(c_real) - math.exp(b_real)
        sum_dp += dp
        sq_dp += dp * dp
        ln_ratio += b_real - c_real
        cand_by_id = dict(zip(c_ids, c_lp))
        kl = p_known = q_known = p_unreported = 0.0
        unreported = 0
        for token, lp in zip(b_ids, b_lp):
            if token in cand_by_id:
                lq = cand_by_id[token]
                p = math.exp(lp)
                kl += p * (lp - lq)
                p_known += p
                q_known += math.exp(lq)
            else:
                p_unreported += math.exp(lp)
                unreported += 1
        p_other = min(max(1.0 - p_known - p_unreported, 0.0), 1.0)
        s = min(max(1.0 - q_known + floor, floor), 1.0)
        p_rest = p_unreported + p_other
        rest = p_rest * math.log(p_rest / s) if p_rest > 0 else 0.0
        if unreported:
            # The candidate's mass on the baseline ids it did not report: at most its smallest reported
            # probability each and its unreported mass in all; the bound takes the least KL it allows.
            reported = [math.exp(lq) for lq in c_lp]
            cap = min(unreported * min(reported) * (1 + rounding), 1.0 - sum(reported) * (1 - rounding), s)
            cap = max(cap, floor)
            if s * p_unreported > cap * p_rest:
                rest = p_unreported * math.log(p_unreported / cap)
                rest += p_other * math.log(p_other / (s - cap)) if p_other > 0 else 0.0
        kl_sum += max(kl + rest, 0.0)
    n = len(base[0])
    return {
        "same_top": same / n,
        "mean_dp": sum_dp / n,
        "rms_dp": math.sqrt(sq_dp / n),
        "ppl_ratio": math.exp(ln_ratio / n),
        "mean_kl": kl_sum / n,
    }


def best_of(repeats: int, fn):
    """Best wall time of ``repeats`` calls, and the last call's result."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def head(run: LogprobRun, n: int) -> LogprobRun:
    return LogprobRun(run.real_logprob[:n], run.top_ids[:n], run.top_logprobs[:n])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--positions", type=int, default=1_000_000)
    parser.add_argument("--subsample", type=int, default=100_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n, sub = args.positions, min(args.subsample, args.positions)

    base, cand = synthetic_pair(n, args.seed)
    load = os.getloadavg()[0]  # other work on the machine slows both timings
    numpy_s, result = best_of(3, lambda: compare_logprobs(base, cand))

    # Check both implementations agree before comparing their speed.
    sub_base, sub_cand = as_lists(base, sub), as_lists(cand, sub)
    start = time.perf_counter()
    looped = python_loop(sub_base, sub_cand)
    python_sub_s = time.perf_counter() - start
    vectorised = compare_logprobs(head(base, sub), head(cand, sub)).as_dict()
    for key, value in looped.items():
        assert math.isclose(vectorised[key], value, rel_tol=1e-9, abs_tol=1e-12), key
    python_s = python_sub_s * n / sub

    print(
        f"compare_logprobs: {n:,} positions x top-{K}, seed {args.seed}, "
        f"{os.cpu_count()} CPUs, load average {load:.2f} before the run"
    )
    print(f"  same_top {result.same_top:.5f}  rms_dp {result.rms_dp:.5f}  "
          f"ppl_ratio {result.ppl_ratio:.6f}  mean_kl {result.mean_kl:.6f} ({result.kl_kind})")
    print(f"  {'numpy, best of 3':<44} {numpy_s:8.3f} s")
    print(f"  {f'pure Python, {sub:,} positions scaled x{n / sub:g}':<44} {python_s:8.3f} s"
          f"   (measured {python_sub_s:.3f} s)")
    print(f"  {'speedup':<44} {python_s / numpy_s:8.1f} x")


if __name__ == "__main__":
    main()
