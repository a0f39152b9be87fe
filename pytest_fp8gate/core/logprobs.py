"""Compare a candidate's token probabilities with its baseline's on the same text.

Pure numpy. The probability check follows llama.cpp's ``--kl-divergence``
summary (same top token, delta-p, perplexity ratio, KL divergence with
percentiles).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ComparisonError
from .answers import binomial_se
from .buckets import buckets_of

__all__ = [
    "PERCENTILES",
    "ComparisonError",
    "LogprobComparison",
    "LogprobRun",
    "PositionBucket",
    "check_vocabulary",
    "clustered_se",
    "compare_logprobs",
    "kl_per_position",
    "logprobs_on_base_ids",
    "sequence_clusters",
]

# Labels and percentile ranks in the order llama.cpp prints its KLD summary.
PERCENTILES: tuple[tuple[str, float], ...] = (
    ("max", 100.0),
    ("99.9%", 99.9),
    ("99%", 99.0),
    ("95%", 95.0),
    ("90%", 90.0),
    ("median", 50.0),
    ("10%", 10.0),
    ("5%", 5.0),
    ("1%", 1.0),
    ("0.1%", 0.1),
    ("min", 0.0),
)

# Positions per block in the top-k KL loop: small enough that every temporary
# stays in cache, large enough that per-block Python overhead is negligible.
_BLOCK = 4096
# Elements per block when reading full-vocabulary distributions.
_FULL_BLOCK_ELEMENTS = 1 << 20
# Threads for block loops; numpy releases the GIL, so each one can use a core.
_WORKERS = min(
    8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)


TOPK_KL = "top-k lower bound"  # the kl_kind of a KL over the baseline's top-k plus a tail bucket


def _array(value: Any, name: str, dtype: Any, ndim: int) -> np.ndarray:
    array = np.asarray(value, dtype=dtype)
    if array.ndim != ndim:
        raise ComparisonError(f"{name} must be {ndim}-D, got shape {array.shape}")
    return array


@dataclass(frozen=True, eq=False)
class LogprobRun:
    """One model's pass over a fixed token sequence (N scored positions).

    ``real_logprob``: [N] log-probability of the real next token.
    ``top_ids`` / ``top_logprobs``: [N, k] top-k token ids and log-probs, column 0
    the most likely token; log-probs may be NaN where only the ids are known.
    ``full_logprobs``: optional [N, V] log-probs over the whole vocabulary.
    ``logprobs_on_base_ids``: optional [N, k_base] this run's log-probs on the
    baseline's top-k ids, column-aligned with the baseline; NaN where unknown.
    ``token_ids``: optional [N] ids of the real next tokens, used to check that
    two runs scored the same text.
    """

    real_logprob: np.ndarray
    top_ids: np.ndarray
    top_logprobs: np.ndarray
    full_logprobs: np.ndarray | None = None
    logprobs_on_base_ids: np.ndarray | None = None
    token_ids: np.ndarray | None = None

    def __post_init__(self) -> None:
        fields = {
            "real_logprob": _array(self.real_logprob, "real_logprob", np.float64, 1),
            "top_ids": _array(self.top_ids, "top_ids", np.int64, 2),
            "top_logprobs": _array(self.top_logprobs, "top_logprobs", np.float64, 2),
        }
        if self.full_logprobs is not None:
            # Keep the caller's float width: a float32 [N, V] array can be large.
            full = np.asarray(self.full_logprobs)
            if full.ndim != 2 or not np.issubdtype(full.dtype, np.floating):
                raise ComparisonError(
                    f"full_logprobs must be a 2-D float array, got {full.dtype} {full.shape}"
                )
            fields["full_logprobs"] = full
        if self.logprobs_on_base_ids is not None:
            fields["logprobs_on_base_ids"] = _array(
                self.logprobs_on_base_ids, "logprobs_on_base_ids", np.float64, 2
            )
        if self.token_ids is not None:
            fields["token_ids"] = _array(self.token_ids, "token_ids", np.int64, 1)
        n = fields["real_logprob"].shape[0]
        for name, array in fields.items():
            if array.shape[0] != n:
                raise ComparisonError(
                    f"{name} has {array.shape[0]} positions but real_logprob has {n}"
                )
        if fields["top_ids"].shape != fields["top_logprobs"].shape:
            raise ComparisonError(
                f"top_ids {fields['top_ids'].shape} and top_logprobs "
                f"{fields['top_logprobs'].shape} must have the same shape"
            )
        if fields["top_ids"].shape[1] == 0:
            raise ComparisonError("top_ids needs at least one column (the top-1 token)")
        _check_values(fields)
        for name, array in fields.items():
            object.__setattr__(self, name, array)

    @property
    def positions(self) -> int:
        return int(self.real_logprob.shape[0])


_MAX_EXP = math.log(np.finfo(np.float64).max)  # math.exp raises OverflowError above it

# A log-prob above this is no rounding of log(1) = 0 (float32 engines land within 1e-6 of it).
_LOGPROB_SLACK = 1e-4
# A full distribution whose probabilities sum further from 1 than this is not one.
_MASS_TOLERANCE = 1e-3


def _check_values(fields: dict[str, np.ndarray]) -> None:
    """Refuse arrays that cannot be what they claim: NaN where a log-prob is due, log-probs above 0
    (+inf among them), negative token ids, unnormalised rows. -inf (probability 0) is a log-prob.

    NaN is allowed only as "not given": all of ``top_logprobs`` (a dump that records the top ids
    alone) or entries of ``logprobs_on_base_ids`` (ids the engine did not score)."""
    nan_allowed = {"logprobs_on_base_ids": True, "top_logprobs": bool(np.isnan(fields["top_logprobs"]).all())}
    for name in ("real_logprob", "top_logprobs", "logprobs_on_base_ids", "full_logprobs"):
        array = fields.get(name)
        if array is None:
            continue
        if not nan_allowed.get(name, False):
            _refuse_first(name, array, np.isnan(array), "{name} holds NaN at position {position}; "
                          "a log-probability is due at every position and rank")
        _refuse_first(name, array, np.nan_to_num(array, nan=-np.inf) > _LOGPROB_SLACK,
                      "{name} holds {value:.6g} at position {position}; a log-probability is at most 0")
    for name in ("top_ids", "token_ids"):
        array = fields.get(name)
        if array is not None:
            _refuse_first(name, array, array < 0, "{name} holds the negative token id {value} at position {position}")
    full = fields.get("full_logprobs")
    if full is not None and full.size:
        _check_normalised(full)


def _refuse_first(name: str, array: np.ndarray, bad: np.ndarray, message: str) -> None:
    """ComparisonError with ``message`` formatted for the first entry where ``bad`` holds: its
    array's ``name``, its ``value`` and its ``position`` (row)."""
    found = np.flatnonzero(bad)
    if found.size:
        position = int(np.unravel_index(found[0], array.shape)[0])
        raise ComparisonError(message.format(name=name, value=array.flat[found[0]], position=position))


def check_vocabulary(run: LogprobRun, vocab_size: int) -> None:
    """Refuse token ids at or beyond the vocabulary size, naming the first one and its position."""
    for name in ("top_ids", "token_ids"):
        array = getattr(run, name)
        if array is not None:
            _refuse_first(name, array, array >= vocab_size, "{name} holds the token id {value} at position "
                          f"{{position}}, beyond the vocabulary of {vocab_size} ids")


def _check_normalised(full: np.ndarray) -> None:
    block = max(1, _FULL_BLOCK_ELEMENTS // full.shape[1])
    for start in range(0, full.shape[0], block):
        mass = np.exp(full[start:start + block].astype(np.float64)).sum(axis=1)
        bad = np.flatnonzero(~(np.abs(mass - 1.0) <= _MASS_TOLERANCE))  # NaN counts as bad
        if bad.size:
            raise ComparisonError(
                f"full_logprobs at position {start + bad[0]} sums to probability {mass[bad[0]]:.6g}, "
                "not 1; not a distribution over the vocabulary"
            )


@dataclass(frozen=True)
class LogprobComparison:
    """Candidate vs baseline on the same tokens; fractions, not percentages.

    Every ``*_se`` field is clustered by sequence (an addition: CR1 over the ``clusters`` chunks or
    continuations, since positions of one text are not independent); the rules' allowances read these.
    Its ``*_se_iid`` twin treats positions as independent, as llama.cpp reports it: the binomial
    sqrt(p(1-p)/N) for ``same_top``, sample SD / sqrt(N) for the means. ``rms_dp_se`` carries the SE of
    mean(dp^2) through the square root (delta method). With one sequence (or none given) the
    clustered SE is the iid one.
    ``kl_kind`` is "exact" (both full distributions), "top-k lower bound" or
    "unavailable" (then the KL fields are None). ``buckets``: the same figures on the
    positions of each position bucket, where the rows' positions were given (an addition).
    """

    positions: int
    same_top: float
    same_top_se: float
    mean_dp: float
    mean_dp_se: float
    rms_dp: float
    rms_dp_se: float
    dp_percentiles: dict[str, float]
    ppl_ratio: float
    ln_ppl_ratio: float
    ln_ppl_ratio_se: float
    kl_kind: str
    mean_kl: float | None
    kl_se: float | None
    kl_percentiles: dict[str, float] | None
    clusters: int = 1
    same_top_se_iid: float = 0.0
    mean_dp_se_iid: float = 0.0
    rms_dp_se_iid: float = 0.0
    ln_ppl_ratio_se_iid: float = 0.0
    kl_se_iid: float | None = None
    # The 99th percentile of KL and its SE (an addition: the order statistics' 95% interval over 2 x 1.96).
    kl_p99: float | None = None
    kl_p99_se: float | None = None
    # KL at each position, kept for the plots so that nothing computes it twice (not serialised).
    kl_values: np.ndarray | None = field(default=None, repr=False, compare=False)
    buckets: tuple[PositionBucket, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        figures = asdict(replace(self, kl_values=None, buckets=()))
        del figures["kl_values"]
        figures["buckets"] = [bucket.as_dict() for bucket in self.buckets]
        return figures

    def bucket(self, label: str) -> LogprobComparison | None:
        """The figures of the bucket ``label``, None where no position fell in it."""
        return next((b.comparison for b in self.buckets if b.label == label), None)


@dataclass(frozen=True)
class PositionBucket:
    """The figures on the positions in [start, end) of their sequences (end None: no upper end)."""

    label: str
    start: int
    end: int | None
    comparison: LogprobComparison

    def as_dict(self) -> dict[str, Any]:
        figures = self.comparison.as_dict()
        del figures["buckets"]
        return {"bucket": self.label, "start": self.start, "end": self.end, **figures}


def _mean_se(values: np.ndarray) -> tuple[float, float]:
    n = values.shape[0]
    se = float(values.std(ddof=1)) / math.sqrt(n) if n > 1 else 0.0
    return float(values.mean()), se


def clustered_se(values: np.ndarray, clusters: np.ndarray, iid_se: float) -> float:
    """The CR1 cluster-robust SE of ``values``' mean (an addition): with G clusters of residual sums
    S_g, sqrt(G / (G - 1) * sum S_g^2) / N. Positions of one sequence share its text and drift
    together, so their spread understates the mean's. ``clusters``: each row's cluster index
    (0..G-1, any order). One cluster gives nothing to measure between them: ``iid_se``."""
    count = int(clusters.max()) + 1 if clusters.size else 0
    if count < 2:
        return iid_se
    residual_sums = np.bincount(clusters, weights=values - values.mean(), minlength=count)
    return math.sqrt(count / (count - 1) * float(np.dot(residual_sums, residual_sums))) / values.shape[0]


def sequence_clusters(positions: np.ndarray) -> np.ndarray:
    """Each row's sequence index, from the rows' positions in their sequences: a sequence's rows rise
    in position, so a new one starts wherever the position does not."""
    starts = np.concatenate(([False], np.diff(positions) <= 0))
    return np.cumsum(starts)


def _p99_se(values: np.ndarray) -> float:
    """The SE of the 99th percentile, from the distribution-free interval of the order statistics: the
    ranks n*0.99 -/+ 1.96 sqrt(n*0.99*0.01), whose values' distance over 2 x 1.96 reads as one SE."""
    n = values.shape[0]
    spread = 1.96 * math.sqrt(n * 0.99 * 0.01)
    low, high = (min(n - 1, max(0, int(round(n * 0.99 + shift)))) for shift in (-spread, spread))
    ordered = np.partition(values, sorted({low, high}))
    return float(ordered[high] - ordered[low]) / (2 * 1.96)


def _percentiles(values: np.ndarray) -> dict[str, float]:
    ranks = np.percentile(values, [rank for _, rank in PERCENTILES])
    return {label: float(v) for (label, _), v in zip(PERCENTILES, ranks)}


def compare_logprobs(base: LogprobRun, cand: LogprobRun, positions: np.ndarray | None = None,
                     edges: Sequence[int] = ()) -> LogprobComparison:
    """Compare two passes over the same tokens the way llama.cpp does.

    ``dp = exp(cand.real) - exp(base.real)`` per position and
    ``ppl_ratio = exp(mean(base.real - cand.real))`` = PPL(cand) / PPL(base).
    With ``positions`` (each row's position in its sequence) the same figures are also
    given per bucket of positions cut at ``edges`` (buckets.py), from the same per-position values.
    """
    n = base.positions
    if cand.positions != n:
        raise ComparisonError(
            f"baseline has {n} positions but candidate has {cand.positions}; "
            "both runs must score the same tokens"
        )
    if n == 0:
        raise ComparisonError("no positions to compare")
    if base.token_ids is not None and cand.token_ids is not None:
        differs = np.flatnonzero(base.token_ids != cand.token_ids)
        if differs.size:
            raise ComparisonError(
                f"runs scored different text: first differing token at position {differs[0]}"
            )
    same = base.top_ids[:, 0] == cand.top_ids[:, 0]
    dp = np.exp(cand.real_logprob) - np.exp(base.real_logprob)
    with np.errstate(invalid="ignore"):  # -inf - -inf: both gave the real token probability 0, no difference
        ln_ratio = np.where(base.real_logprob == cand.real_logprob, 0.0, base.real_logprob - cand.real_logprob)
    kl_kind, kl = kl_per_position(base, cand)
    if positions is None:
        return replace(_summarise(same, dp, ln_ratio, kl_kind, kl), kl_values=kl)
    if positions.shape != (n,):
        raise ComparisonError(f"{positions.shape[0]} row positions for {n} scored rows")
    clusters = sequence_clusters(positions)
    whole = _summarise(same, dp, ln_ratio, kl_kind, kl, clusters)
    buckets = tuple(PositionBucket(label, start, end, _summarise(same[mask], dp[mask], ln_ratio[mask], kl_kind,
                                                                None if kl is None else kl[mask],
                                                                _renumbered(clusters[mask])))
                    for label, start, end, mask in buckets_of(positions, edges))
    return replace(whole, kl_values=kl, buckets=buckets)


def _renumbered(clusters: np.ndarray) -> np.ndarray:
    """Cluster indices 0..G-1 for the clusters a subset of rows still holds."""
    return np.unique(clusters, return_inverse=True)[1].reshape(-1)


def _summarise(same: np.ndarray, dp: np.ndarray, ln_ratio: np.ndarray, kl_kind: str,
               kl: np.ndarray | None, clusters: np.ndarray | None = None) -> LogprobComparison:
    """The figures of one set of rows from their per-position values; ``clusters``: each row's sequence
    (None: one sequence)."""
    n = same.shape[0]
    if clusters is None:
        clusters = np.zeros(n, dtype=np.int64)
    same_top = float(np.mean(same))
    mean_dp, mean_dp_se_iid = _mean_se(dp)
    mean_square_dp, mean_square_dp_se_iid = _mean_se(dp * dp)
    rms_dp = math.sqrt(mean_square_dp)
    ln_ppl_ratio, ln_ppl_ratio_se_iid = _mean_se(ln_ratio)
    mean_kl, kl_se_iid = _mean_se(kl) if kl is not None else (None, None)
    kl_percentiles = _percentiles(kl) if kl is not None else None

    def rms_se(mean_square_se: float) -> float:
        return mean_square_se / (2 * rms_dp) if rms_dp > 0 else 0.0

    same_top_se_iid = binomial_se(same_top, n)
    return LogprobComparison(
        positions=n,
        same_top=same_top,
        same_top_se=clustered_se(same.astype(np.float64), clusters, same_top_se_iid),
        mean_dp=mean_dp,
        mean_dp_se=clustered_se(dp, clusters, mean_dp_se_iid),
        rms_dp=rms_dp,
        rms_dp_se=rms_se(clustered_se(dp * dp, clusters, mean_square_dp_se_iid)),
        dp_percentiles=_percentiles(dp),
        ppl_ratio=math.exp(ln_ppl_ratio) if ln_ppl_ratio < _MAX_EXP else math.inf,
        ln_ppl_ratio=ln_ppl_ratio,
        ln_ppl_ratio_se=clustered_se(ln_ratio, clusters, ln_ppl_ratio_se_iid),
        kl_kind=kl_kind,
        mean_kl=mean_kl,
        kl_se=None if kl is None or kl_se_iid is None else clustered_se(kl, clusters, kl_se_iid),
        kl_percentiles=kl_percentiles,
        clusters=int(clusters.max()) + 1 if n else 0,
        same_top_se_iid=same_top_se_iid,
        mean_dp_se_iid=mean_dp_se_iid,
        rms_dp_se_iid=rms_se(mean_square_dp_se_iid),
        ln_ppl_ratio_se_iid=ln_ppl_ratio_se_iid,
        kl_se_iid=kl_se_iid,
        kl_p99=None if kl_percentiles is None else kl_percentiles["99%"],
        kl_p99_se=None if kl is None else _p99_se(kl),
    )


def kl_per_position(base: LogprobRun, cand: LogprobRun) -> tuple[str, np.ndarray | None]:
    """KL(base || cand) at each position and its kind (see LogprobComparison.kl_kind)."""
    if base.full_logprobs is not None and cand.full_logprobs is not None:
        if base.full_logprobs.shape != cand.full_logprobs.shape:
            raise ComparisonError(
                f"full_logprobs shapes differ: {base.full_logprobs.shape} vs "
                f"{cand.full_logprobs.shape}"
            )
        return "exact", _exact_kl(base.full_logprobs, cand.full_logprobs)
    on_base = cand.logprobs_on_base_ids
    if on_base is not None and on_base.shape != base.top_ids.shape:
        raise ComparisonError(
            f"candidate logprobs_on_base_ids has shape {on_base.shape}, "
            f"expected the baseline's top-k shape {base.top_ids.shape}"
        )
    cand_source = on_base if on_base is not None else cand.top_logprobs
    if np.isnan(base.top_logprobs).all() or np.isnan(cand_source).all():
        return "unavailable", None
    return TOPK_KL, _topk_kl_lower_bound(base, cand)


def logprobs_on_base_ids(base: LogprobRun, cand: LogprobRun) -> np.ndarray:
    """The candidate's log-probs on the baseline's top-k ids, [N, k_base], NaN where unknown:
    scored on those ids where the engine could, else found in the candidate's own top-k."""
    if cand.logprobs_on_base_ids is not None:
        return cand.logprobs_on_base_ids
    return _lookup_on_base_ids(base.top_ids, cand.top_ids, cand.top_logprobs).T


def _blockwise(n: int, block: int, kl_of: Callable[[slice], np.ndarray]) -> np.ndarray:
    """Evaluate ``kl_of`` on consecutive row blocks, spread over _WORKERS threads."""
    kl = np.empty(n)

    def fill(start: int) -> None:
        rows = slice(start, min(start + block, n))
        kl[rows] = kl_of(rows)

    starts = range(0, n, block)
    if _WORKERS > 1 and len(starts) > 1:
        with ThreadPoolExecutor(_WORKERS) as pool:
            list(pool.map(fill, starts))  # list() re-raises worker exceptions
    else:
        for start in starts:
            fill(start)
    return np.maximum(kl, 0.0, out=kl)  # float cancellation can leave -1e-17


def _exact_kl(base_full: np.ndarray, cand_full: np.ndarray) -> np.ndarray:
    n, vocab = base_full.shape

    def kl_of(rows: slice) -> np.ndarray:
        lp = base_full[rows].astype(np.float64)
        lq = cand_full[rows].astype(np.float64)
        p = np.exp(lp)
        with np.errstate(invalid="ignore"):
            # Tokens the baseline gives zero probability contribute nothing,
            # even where the candidate's log-prob is also -inf.
            terms = np.where(p > 0, p * (lp - lq), 0.0)
        return terms.sum(axis=1)

    return _blockwise(n, max(1, _FULL_BLOCK_ELEMENTS // vocab), kl_of)


def _topk_kl_lower_bound(base: LogprobRun, cand: LogprobRun) -> np.ndarray:
    """KL over a coarser partition of the vocabulary, so never above the true KL.

    The cells: each baseline top-k id whose candidate log-prob is known (scored
    on the baseline's ids, or found in the candidate's own top-k); one bucket of
    the baseline ids the candidate did not report; one of everything else. The
    candidate's mass on the unreported bucket is not known, only capped (see
    ``_partition_kl``); the bound takes the least KL any allowed mass gives.
    Merging outcomes cannot increase KL (data-processing inequality).
    """

    def kl_of(rows: slice) -> np.ndarray:
        # Work position-minor ([k, block]) so that per-column operations run
        # over contiguous memory and sums over k are plain row additions.
        lp = np.ascontiguousarray(base.top_logprobs[rows].T)
        if cand.logprobs_on_base_ids is not None:
            lq = np.ascontiguousarray(cand.logprobs_on_base_ids[rows].T)
            unknown = np.isnan(lq)
            if unknown.any():  # ids the engine did not score may still be in the candidate's own top-k
                found = _lookup_on_base_ids(base.top_ids[rows], cand.top_ids[rows], cand.top_logprobs[rows])
                lq = np.where(unknown, found, lq)
        else:
            lq = _lookup_on_base_ids(
                base.top_ids[rows], cand.top_ids[rows], cand.top_logprobs[rows]
            )
        return _partition_kl(lp, lq, cand.top_logprobs[rows])

    return _blockwise(base.positions, _BLOCK, kl_of)


def _lookup_on_base_ids(
    base_ids: np.ndarray, cand_ids: np.ndarray, cand_lp: np.ndarray
) -> np.ndarray:
    """Candidate log-probs at the baseline's top-k ids, [k_base, block], NaN if absent."""
    block, k_cand = cand_ids.shape
    # Vocabulary ids fit in int32; halving the width doubles compare throughput.
    base_t = base_ids.T.astype(np.int32, order="C")
    cand_t = cand_ids.T.astype(np.int32, order="C")
    # slot[j, i] = 1 + the candidate column holding base id j at position i, 0 if
    # none (top-k ids are distinct; were one repeated, the last column wins).
    # The narrowest integer type that holds k + 1 is the fastest to update.
    width = np.min_scalar_type(k_cand + 1)
    slot = np.zeros(base_t.shape, dtype=width)
    match = np.empty(base_t.shape, dtype=bool)
    weighted = np.empty(base_t.shape, dtype=width)
    for column in range(k_cand):
        np.equal(base_t, cand_t[column], out=match)
        np.multiply(match, width.type(column + 1), out=weighted)
        np.maximum(slot, weighted, out=slot)
    # Flat index of (position i, column slot - 1) in the row-major [block, k] input.
    flat = slot + (np.arange(block) * k_cand - 1)
    found = cand_lp.ravel().take(flat, mode="clip")  # clip: slot 0 of position 0
    found[slot == 0] = np.nan
    return found


# Relative error allowed in a probability the candidate reported: float32 log-probs round it by about
# 1e-6, so its reported mass and its k-th probability are known to within this.
_REPORTED_ROUNDING = 1e-5


def _partition_kl(lp: np.ndarray, lq: np.ndarray, cand_lp: np.ndarray) -> np.ndarray:
    """KL(P || Q) over the partition A (baseline ids with a known candidate log-prob, a cell each),
    B (baseline ids the candidate did not report, one bucket) and C (the rest of the vocabulary),
    minimised over the candidate's unknown mass x = Q(B).

    ``lp``, ``lq``: [k, block] the baseline's top-k log-probs and the candidate's on the same ids
    (NaN: not reported); ``cand_lp``: [block, k_c] the candidate's own top-k log-probs. An id the
    candidate did not report has at most its smallest reported probability q_min, and B as a whole
    at most its unreported mass, so x <= U = min(|B| q_min, 1 - its reported mass, Q(B u C)). With
    s = Q(B u C) = 1 - Q(A), the B and C cells add f(x) = P(B) ln(P(B)/x) + P(C) ln(P(C)/(s - x)),
    convex in x with its minimum at x* = s P(B) / (P(B) + P(C)), where f is the one-bucket value
    (P(B) + P(C)) ln((P(B) + P(C)) / s). The bound is f(min(x*, U)): never above f at the true
    Q(B), so never above the KL over the partition, nor the exact KL.
    """
    diff = lp - lq
    # A pair is usable when both log-probs are known (diff not NaN) and the
    # baseline's probability is non-zero (diff not -inf); the others fall into
    # B (not reported) or C, which keeps the partition valid.
    usable = diff > -np.inf
    p = np.zeros_like(lp)
    q = np.zeros_like(lq)
    np.exp(lp, out=p, where=usable)
    np.exp(lq, out=q, where=usable)
    kl = np.multiply(p, diff, out=np.zeros_like(diff), where=usable).sum(axis=0)
    unreported = np.isnan(lq)
    p_b = np.exp(lp, out=np.zeros_like(lp), where=unreported).sum(axis=0)
    p_c = np.clip(1.0 - p.sum(axis=0) - p_b, 0.0, 1.0)
    # The candidate's leftover mass is only known to within the rounding of a
    # k-term sum; adding that keeps the buckets finite and the bound low.
    q_floor = (lp.shape[0] + 1) * np.finfo(np.float64).eps
    s = np.clip(1.0 - q.sum(axis=0) + q_floor, q_floor, 1.0)
    p_rest = p_b + p_c
    with np.errstate(divide="ignore", invalid="ignore"):
        rest = np.where(p_rest > 0, p_rest * np.log(p_rest / s), 0.0)  # B and C as one bucket: f(x*)
    if unreported.any():
        reported = np.exp(cand_lp)
        # NaN (a log-prob not given) counts as 0 in the reported mass and is skipped by fmin: both
        # caps stay at least what they would be, so the bound stays low.
        unreported_mass = 1.0 - np.nansum(reported, axis=1) * (1.0 - _REPORTED_ROUNDING)
        per_id = np.fmin.reduce(reported, axis=1) * (1.0 + _REPORTED_ROUNDING)
        cap = np.maximum(np.fmin(np.fmin(unreported.sum(axis=0) * per_id, unreported_mass), s), q_floor)
        with np.errstate(divide="ignore", invalid="ignore"):
            capped = s * p_b > cap * p_rest  # x* > U, so U < x* <= s and s - U > 0
            split = p_b * np.log(p_b / cap) + np.where(p_c > 0, p_c * np.log(p_c / (s - cap)), 0.0)
        rest = np.where(capped, split, rest)
    return kl + rest
