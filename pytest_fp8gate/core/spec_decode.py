"""Speculative decoding's counters (issue 34): vLLM's ``vllm:spec_decode_*`` counters read from a
server's Prometheus ``/metrics``, differenced over a window of requests.

vLLM's own accuracy CI (tests/evals/gsm8k/test_gsm8k_correctness.py) fails a speculative
config whose mean acceptance length, 1 + accepted tokens / drafts, is too low, because
accuracy alone passes even when every draft is rejected. The counters are cumulative over
the server's life, so a window is the difference of a reading before and after it; a reading
without the counters, a server restarted between two readings (the counter's creation time
moved, or a counter went back) make the window a problem, never a count.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# vLLM's names (vllm/v1/spec_decode/metrics.py, SpecDecodingProm); Prometheus adds _total and _created.
COUNTERS = {"drafts": "vllm:spec_decode_num_drafts", "draft_tokens": "vllm:spec_decode_num_draft_tokens",
            "accepted_tokens": "vllm:spec_decode_num_accepted_tokens"}
SPECULATIVE_FLAGS = ("--speculative-config", "-sc")  # vLLM's EngineArgs: the flag and its alias
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{[^}]*\})?\s+(\S+)", re.MULTILINE)


@dataclass(frozen=True)
class SpecDecodeCounts:
    """vLLM's speculative-decoding counters, summed over its engines (data-parallel ranks)."""

    drafts: float
    draft_tokens: float
    accepted_tokens: float

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step yields on average: the target's own token plus the accepted drafts
        (vLLM's gsm8k CI: 1 + accepted / drafts). NaN without a draft."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts > 0 else float("nan")

    @property
    def draft_acceptance_rate(self) -> float:
        """Accepted over proposed draft tokens (vLLM's logged "Draft acceptance rate")."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else float("nan")

    def __add__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.drafts + other.drafts, self.draft_tokens + other.draft_tokens,
                                self.accepted_tokens + other.accepted_tokens)

    def __sub__(self, other: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                                self.accepted_tokens - other.accepted_tokens)

    def as_dict(self) -> dict[str, float]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "mean_acceptance_length": self.mean_acceptance_length,
                "draft_acceptance_rate": self.draft_acceptance_rate}


@dataclass(frozen=True)
class Reading:
    """One reading of a server's counters; ``counts`` None when there were none (``missing`` says why)."""

    counts: SpecDecodeCounts | None
    created: float | None = None  # the drafts counter's creation time: another one means another server
    missing: str | None = None


@dataclass(frozen=True)
class Window:
    """The counters' movement over one pass of one model ("main": its tasks; "load": [load]'s levels)."""

    label: str
    counts: SpecDecodeCounts | None
    problem: str | None = None  # why there are no counts

    def as_dict(self) -> dict[str, Any]:
        return {"label": self.label, "counts": self.counts.as_dict() if self.counts else None,
                "problem": self.problem}

    @classmethod
    def from_dict(cls, stored: dict[str, Any]) -> Window:
        counts = stored["counts"]
        return cls(stored["label"], None if counts is None else SpecDecodeCounts(
            counts["drafts"], counts["draft_tokens"], counts["accepted_tokens"]), stored["problem"])


def parse_metrics(text: str) -> Reading:
    """The counters in a Prometheus text exposition, each summed over its label sets."""
    sums: dict[str, float] = {}
    created: list[float] = []
    for name, value in _SAMPLE.findall(text):
        try:
            number = float(value)
        except ValueError:
            continue
        if name == f"{COUNTERS['drafts']}_created":
            created.append(number)
        sums[name] = sums.get(name, 0.0) + number
    totals = {field: sums.get(f"{name}_total") for field, name in COUNTERS.items()}
    absent = [f"{COUNTERS[field]}_total" for field, value in totals.items() if value is None]
    if absent:
        return Reading(None, missing=f"/metrics has no {', '.join(absent)} (is the server running speculative "
                                     "decoding, --speculative-config?)")
    return Reading(SpecDecodeCounts(**{field: float(value or 0.0) for field, value in totals.items()}),
                   max(created) if created else None)


def window(label: str, before: Reading, after: Reading) -> Window:
    """The counters' difference from ``before`` to ``after``, or why there is none."""
    for reading in (before, after):
        if reading.counts is None:
            return Window(label, None, reading.missing)
    assert before.counts is not None and after.counts is not None
    if before.created is not None and after.created is not None and before.created != after.created:
        return Window(label, None, f"the server restarted during the {label} pass (the drafts counter was created "
                                   f"at {before.created:.3f}, then at {after.created:.3f}); its counters cover "
                                   "other requests")
    moved = after.counts - before.counts
    if min(moved.drafts, moved.draft_tokens, moved.accepted_tokens) < 0:
        return Window(label, None, f"a counter went back during the {label} pass ({before.counts.as_dict()} -> "
                                   f"{after.counts.as_dict()}): the server restarted")
    return Window(label, moved)


def total(windows: Sequence[Window] | None, who: str, min_drafts: int = 1) -> SpecDecodeCounts:
    """The counts of every window of ``who``; ValueError, naming ``who``, for a window without counts or
    fewer than ``min_drafts`` drafts in all of them (too few verification steps to judge)."""
    if not windows:
        raise ValueError(f"{who}: no speculative-decoding counters were read")
    for part in windows:
        if part.counts is None:
            raise ValueError(f"{who}: {part.label} pass: {part.problem}")
    counts = sum((part.counts for part in windows if part.counts is not None), SpecDecodeCounts(0, 0, 0))
    passes = " and ".join(w.label for w in windows)
    if counts.drafts <= 0:
        raise ValueError(f"{who}: no draft was proposed over the {passes} pass (the counters did not move): the "
                         "speculator never ran on these requests")
    if counts.drafts < min_drafts:
        raise ValueError(f"{who}: {counts.drafts:g} drafts over the {passes} pass, fewer than "
                         f"speculative.min_drafts = {min_drafts}: too few verification steps to judge; generate "
                         "more (more questions, [load]) or lower min_drafts")
    return counts


def speculative_config(argv: Sequence[str]) -> str | None:
    """The ``--speculative-config`` (``-sc``) value of a serve command line (the first flag itself in vLLM's
    dotted form, ``--speculative-config.method ngram``); None without one."""
    for i, arg in enumerate(argv):
        flag, _, value = arg.partition("=")
        if flag in SPECULATIVE_FLAGS:
            return value or (argv[i + 1] if i + 1 < len(argv) else "")
        if flag.startswith(tuple(f"{f}." for f in SPECULATIVE_FLAGS)):
            return arg
    return None
