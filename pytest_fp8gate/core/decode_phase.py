"""Fidelity where the text is written: comparisons on generated positions only.

Pure numpy. A ``DecodeRun`` is one model's greedy continuations of a set of
prompts and the log-probs it gave at each generated position (while decoding,
or by a prefill of ``prompt ids + generated ids``; never re-encoded text). Two
comparisons are made of such runs:

- the decode phase: the baseline's decode-time log-probs against the
  candidate's prefill of the baseline's exact ids (ModelOpt's split of prefill
  from generation, with vLLM PR #53692's point that ids, not text, go back in);
- decode against prefill of one model: its own decode-time log-probs against a
  prefill of the same ids, which shows a KV-cache path that prefill-only
  scoring cannot (sglang#25790, an FP8 KV cache).

Beside KL(base || cand), as additions: the reverse KL(cand || base) and the
expected acceptance rate sum(min(p, q)) a speculative decoder would see with
the candidate drafting for the baseline (ModelOpt PR #1505, llm-compressor#2031).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ComparisonError
from .buckets import buckets_of, sequence_positions
from .logprobs import TOPK_KL, LogprobComparison, LogprobRun, compare_logprobs, logprobs_on_base_ids

__all__ = ["DecodeComparison", "DecodeRun", "compare_decode", "first_departures", "generated_index", "generated_rows"]

UNAVAILABLE = "unavailable"
TOPK_ACCEPTANCE = "top-k lower bound"  # sum(min(p, q)) over the baseline's top-k ids only


@dataclass(frozen=True, eq=False)
class DecodeRun:
    """Greedy continuations of ``prompts`` and the log-probs at every generated position.

    ``logprobs`` holds one row per generated token, sequence after sequence;
    its ``token_ids`` are the generated ids.
    """

    prompts: tuple[tuple[int, ...], ...]
    generated: tuple[tuple[int, ...], ...]
    logprobs: LogprobRun

    def __post_init__(self) -> None:
        if len(self.prompts) != len(self.generated):
            raise ComparisonError(f"{len(self.prompts)} prompts but {len(self.generated)} continuations")
        total = sum(len(g) for g in self.generated)
        if self.logprobs.positions != total:
            raise ComparisonError(f"{self.logprobs.positions} log-prob rows for {total} generated tokens")
        ids = np.fromiter((t for g in self.generated for t in g), dtype=np.int64, count=total)
        if self.logprobs.token_ids is not None and not np.array_equal(self.logprobs.token_ids, ids):
            raise ComparisonError("log-prob rows are not of the generated tokens")

    @property
    def sequences(self) -> tuple[tuple[int, ...], ...]:
        """prompt ids + generated ids of each continuation, what a prefill scores."""
        return tuple(p + g for p, g in zip(self.prompts, self.generated))

    @property
    def lengths(self) -> list[int]:
        return [len(g) for g in self.generated]


def generated_index(prompt_lengths: Sequence[int], generated_lengths: Sequence[int], scored: int) -> np.ndarray:
    """The rows of a prefill over ``prompt + generated`` sequences (``scored`` rows in all) that
    predict the generated tokens.

    A prefill scores positions 1..L-1 of each sequence; the token at index t
    is predicted by row t - 1, so a continuation after a prompt of P tokens
    starts at row P - 1 of its sequence.
    """
    rows, offset = [], 0
    for prompt, generated in zip(prompt_lengths, generated_lengths):
        if prompt < 1:
            raise ComparisonError("a prompt needs at least one token before the continuation")
        start = offset + prompt - 1
        rows.append(np.arange(start, start + generated))
        offset += prompt + generated - 1
    if offset != scored:
        raise ComparisonError(f"prefill has {scored} rows, the sequences {offset} scored positions")
    return np.concatenate(rows) if rows else np.zeros(0, dtype=np.int64)


def generated_rows(prefill: LogprobRun, prompt_lengths: Sequence[int], generated_lengths: Sequence[int]) -> LogprobRun:
    """``prefill`` (over ``prompt + generated`` sequences) at the generated positions only."""
    index = generated_index(prompt_lengths, generated_lengths, prefill.positions)

    def take(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array[index]

    return LogprobRun(prefill.real_logprob[index], prefill.top_ids[index], prefill.top_logprobs[index],
                      full_logprobs=take(prefill.full_logprobs),
                      logprobs_on_base_ids=take(prefill.logprobs_on_base_ids), token_ids=take(prefill.token_ids))


def first_departures(base: DecodeRun, cand: LogprobRun) -> list[int | None]:
    """Per continuation, the first generated position where the candidate's greedy choice
    (its top-1) is not the token the baseline wrote; None where it never departs."""
    top = cand.top_ids[:, 0]
    found, offset = [], 0
    for generated in base.generated:
        differs = np.flatnonzero(top[offset:offset + len(generated)] != np.asarray(generated, dtype=np.int64))
        found.append(int(differs[0]) if differs.size else None)
        offset += len(generated)
    return found


@dataclass(frozen=True)
class DecodeComparison:
    """A comparison on generated positions only: ``logprobs`` holds the probability
    check's figures (same top, RMS dp, KL exact or the top-k lower bound); the rest
    are additions. ``first_departure`` is censored: a continuation the candidate
    never departs from counts its length. ``*_se`` are SEs of a mean."""

    sequences: int
    logprobs: LogprobComparison
    reverse_kl_kind: str
    mean_reverse_kl: float | None
    reverse_kl_se: float | None
    acceptance_kind: str
    acceptance_rate: float | None
    acceptance_se: float | None
    departed: int  # continuations where the candidate's greedy choice departs
    mean_first_departure: float
    first_departures: tuple[int | None, ...]
    # The additions per position bucket (issue 34), by the bucket labels of ``logprobs.buckets``.
    bucket_additions: dict[str, dict[str, float | None]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        # The nested comparison serialises itself: its per-position KL array stays out of the JSON.
        return {**asdict(replace(self, logprobs=replace(self.logprobs, kl_values=None))),
                "logprobs": self.logprobs.as_dict()}

    @property
    def same_top(self) -> float:
        return self.logprobs.same_top

    @property
    def rms_dp(self) -> float:
        return self.logprobs.rms_dp

    @property
    def mean_kl(self) -> float | None:
        return self.logprobs.mean_kl


def compare_decode(base: DecodeRun, cand: LogprobRun, edges: Sequence[int] | None = None) -> DecodeComparison:
    """``base``'s log-probs against ``cand``'s on the same generated tokens.

    ``cand`` is a candidate's prefill of the baseline's ids, or, for the gap of
    one model, its own prefill of its own decode run's ids. With ``edges`` the
    probability figures are also given per position bucket (a generated token's
    position is its prompt's length plus its index in the continuation).
    """
    if cand.positions != base.logprobs.positions:
        raise ComparisonError(f"{base.logprobs.positions} generated positions but {cand.positions} scored")
    if cand.positions == 0:
        raise ComparisonError("no generated positions to compare (every continuation is empty)")
    positions = None if edges is None else sequence_positions([len(p) for p in base.prompts], base.lengths)
    comparison = compare_logprobs(base.logprobs, cand, positions, edges or ())
    reverse_kind, reverse = reverse_kl_per_position(base.logprobs, cand)
    acceptance_kind, acceptance = acceptance_per_position(base.logprobs, cand)
    departures = first_departures(base, cand)
    censored = [d if d is not None else n for d, n in zip(departures, base.lengths)]
    additions = {} if positions is None else {
        label: {"mean_reverse_kl": _mean(None if reverse is None else reverse[mask]),
                "acceptance_rate": _mean(None if acceptance is None else acceptance[mask])}
        for label, _, _, mask in buckets_of(positions, edges or ())}
    return DecodeComparison(
        sequences=len(base.generated),
        logprobs=comparison,
        reverse_kl_kind=reverse_kind,
        mean_reverse_kl=_mean(reverse),
        reverse_kl_se=_se(reverse),
        acceptance_kind=acceptance_kind,
        acceptance_rate=_mean(acceptance),
        acceptance_se=_se(acceptance),
        departed=sum(d is not None for d in departures),
        mean_first_departure=float(np.mean(censored)),
        first_departures=tuple(departures),
        bucket_additions=additions,
    )


def reverse_kl_per_position(base: LogprobRun, cand: LogprobRun) -> tuple[str, np.ndarray | None]:
    """KL(cand || base) per position: exact over full distributions, else over the baseline's
    top-k ids both runs know plus one bucket of the rest (a lower bound, like the forward one)."""
    if base.full_logprobs is not None and cand.full_logprobs is not None:
        full_p = base.full_logprobs.astype(np.float64)
        full_q = cand.full_logprobs.astype(np.float64)
        with np.errstate(invalid="ignore"):
            # Tokens the candidate gives zero probability contribute nothing.
            terms = np.where(full_q > -np.inf, np.exp(full_q) * (full_q - full_p), 0.0)
        return "exact", np.maximum(terms.sum(axis=1), 0.0)
    lp, lq = _on_base_ids(base, cand)
    if lq is None:
        return UNAVAILABLE, None
    usable = np.isfinite(lp) & np.isfinite(lq)
    p = np.exp(np.where(usable, lp, -np.inf))
    q = np.exp(np.where(usable, lq, -np.inf))
    with np.errstate(invalid="ignore"):
        kl = np.where(usable, q * (lq - lp), 0.0).sum(axis=1)
    q_rest = np.clip(1.0 - q.sum(axis=1), 0.0, 1.0)
    p_rest = np.clip(1.0 - p.sum(axis=1), lp.shape[1] * np.finfo(np.float64).eps, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        kl += np.where(q_rest > 0, q_rest * np.log(q_rest / p_rest), 0.0)
    return TOPK_KL, np.maximum(kl, 0.0)


def acceptance_per_position(base: LogprobRun, cand: LogprobRun) -> tuple[str, np.ndarray | None]:
    """sum over tokens of min(p, q) per position: exact over full distributions, else over the
    baseline's top-k ids both runs know (the unseen tokens can only add to it: a lower bound)."""
    if base.full_logprobs is not None and cand.full_logprobs is not None:
        p = np.exp(base.full_logprobs.astype(np.float64))
        q = np.exp(cand.full_logprobs.astype(np.float64))
        return "exact", np.minimum(p, q).sum(axis=1)
    lp, lq = _on_base_ids(base, cand)
    if lq is None:
        return UNAVAILABLE, None
    both = np.fmin(np.nan_to_num(lp, nan=-np.inf), np.nan_to_num(lq, nan=-np.inf))
    return TOPK_ACCEPTANCE, np.exp(both).sum(axis=1)


def _on_base_ids(base: LogprobRun, cand: LogprobRun) -> tuple[np.ndarray, np.ndarray | None]:
    """The baseline's top-k log-probs and the candidate's on the same ids ([N, k], NaN unknown)."""
    lq = logprobs_on_base_ids(base, cand)
    if np.isnan(base.top_logprobs).all() or np.isnan(lq).all():
        return base.top_logprobs, None
    return base.top_logprobs, lq


def _mean(values: np.ndarray | None) -> float | None:
    return None if values is None else float(values.mean())


def _se(values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    return float(values.std(ddof=1)) / math.sqrt(len(values)) if len(values) > 1 else 0.0
