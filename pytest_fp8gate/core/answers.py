"""Compare two graded runs of the same questions: accuracies, flips and their uncertainty.

Pure Python and numpy; the flip rule's error rates (``detectable_flip_rate``)
are exact binomial sums, not simulations.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ..errors import ComparisonError

__all__ = [
    "AnswerComparison",
    "AnswerRecord",
    "FlippedAnswer",
    "Thinking",
    "binomial_se",
    "compare_answers",
    "detectable_drop",
    "detectable_flip_rate",
    "drop_fails_from",
    "drop_power",
    "final_answer",
    "flip_ratio_p",
    "flip_rule_power",
    "invalid_rate",
    "is_invalid",
    "length_drift",
    "mcnemar_exact_p",
    "paired_drop_p",
    "paired_se",
    "pooled_floor",
    "thinking_lengths",
]


def binomial_se(p: float, n: int) -> float:
    """The article's sqrt(p(1-p)/n) of a proportion p over n trials (not lm-eval's n-1 version)."""
    return math.sqrt(p * (1.0 - p) / n)


@dataclass(frozen=True)
class AnswerRecord:
    """One graded answer: a question (doc_id) under one answer-extraction filter."""

    doc_id: Hashable
    filter: str
    correct: bool
    prompt_hash: str | None
    response: str
    target: str


@dataclass(frozen=True)
class FlippedAnswer:
    """A question graded differently by the two runs."""

    doc_id: Hashable
    base_response: str
    cand_response: str
    target: str
    direction: str  # "right_to_wrong" or "wrong_to_right"


@dataclass(frozen=True)
class AnswerComparison:
    """Answer-by-answer comparison; accuracies and SEs are fractions."""

    questions: int
    flips: int
    flip_rate: float
    right_to_wrong: int
    wrong_to_right: int
    accuracy_base: float
    accuracy_cand: float
    se_base: float
    se_cand: float
    mcnemar_p: float
    flipped: tuple[FlippedAnswer, ...]

    def as_dict(self) -> dict[str, Any]:
        result = asdict(self)
        result["flipped"] = [asdict(flip) for flip in self.flipped]
        return result


def mcnemar_exact_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """Exact two-sided McNemar p-value: binomial(b + c, 1/2) test on discordant pairs.

    Computed with integers, so it stays exact for thousands of flips.
    """
    if right_to_wrong < 0 or wrong_to_right < 0:
        raise ValueError("flip counts must be non-negative")
    n = right_to_wrong + wrong_to_right
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(right_to_wrong, wrong_to_right) + 1))
    return min(1.0, 2 * tail / 2**n)


def paired_drop_p(right_to_wrong: int, wrong_to_right: int) -> float:
    """One-sided exact McNemar p-value of "the candidate answers no worse" (an addition): P(X >= b) for
    X ~ Binomial(b + c, 1/2), b the right-to-wrong and c the wrong-to-right answers. Integers, as above."""
    if right_to_wrong < 0 or wrong_to_right < 0:
        raise ValueError("flip counts must be non-negative")
    n = right_to_wrong + wrong_to_right
    return sum(math.comb(n, i) for i in range(right_to_wrong, n + 1)) / 2**n


def paired_se(discordant: int, questions: int) -> float:
    """SE of the accuracy drop over paired answers, sqrt(D)/n for D discordant answers (an addition): the
    questions both runs grade alike add nothing to the difference's spread."""
    return math.sqrt(discordant) / questions


def _index_by_question(
    records: Sequence[AnswerRecord], side: str
) -> dict[tuple[Hashable, str], AnswerRecord]:
    index: dict[tuple[Hashable, str], AnswerRecord] = {}
    for record in records:
        key = (record.doc_id, record.filter)
        if key in index:
            raise ComparisonError(
                f"{side} run has doc_id {record.doc_id!r} twice under filter {record.filter!r}"
            )
        index[key] = record
    return index


def _same_doc_id_types(base: Sequence[AnswerRecord], cand: Sequence[AnswerRecord]) -> None:
    """doc_id 0 and doc_id "0" are different keys: name the mismatch instead of a missing question."""
    def kinds(records: Sequence[AnswerRecord]) -> dict[str, Hashable]:
        return {type(record.doc_id).__name__: record.doc_id for record in records}

    base_kinds, cand_kinds = kinds(base), kinds(cand)
    if base_kinds.keys() != cand_kinds.keys():
        def shown(found: dict[str, Hashable]) -> str:
            return ", ".join(f"{name} (e.g. {example!r})" for name, example in sorted(found.items()))
        raise ComparisonError(f"doc_id types differ: the baseline's are {shown(base_kinds)}, the candidate's "
                              f"{shown(cand_kinds)}; the files were written by different tools or versions")


def compare_answers(
    base: Sequence[AnswerRecord], cand: Sequence[AnswerRecord]
) -> AnswerComparison:
    """Pair answers by (doc_id, filter) and count flips.

    Both runs must hold the same questions asked with the same prompts
    (``prompt_hash``); anything else raises ComparisonError naming the first
    offending doc_id rather than comparing different questions.

    ``mcnemar_p`` is an addition to the article's procedure: the exact paired
    test on the flips, which says whether right-to-wrong and wrong-to-right
    flips are too lopsided to be noise.
    """
    base_index = _index_by_question(base, "baseline")
    cand_index = _index_by_question(cand, "candidate")
    if not base_index:
        raise ComparisonError("no answers to compare")
    _same_doc_id_types(base, cand)
    for key in base_index:
        if key not in cand_index:
            raise ComparisonError(f"doc_id {key[0]!r} (filter {key[1]!r}) missing from candidate")
    for key in cand_index:
        if key not in base_index:
            raise ComparisonError(f"doc_id {key[0]!r} (filter {key[1]!r}) missing from baseline")

    flipped = []
    for key, b in base_index.items():
        c = cand_index[key]
        if b.prompt_hash != c.prompt_hash:
            raise ComparisonError(
                f"doc_id {b.doc_id!r}: prompt_hash differs ({b.prompt_hash} vs "
                f"{c.prompt_hash}); the runs did not ask the same question"
            )
        if b.correct != c.correct:
            direction = "right_to_wrong" if b.correct else "wrong_to_right"
            flipped.append(FlippedAnswer(b.doc_id, b.response, c.response, b.target, direction))

    n = len(base_index)
    right_to_wrong = sum(f.direction == "right_to_wrong" for f in flipped)
    wrong_to_right = len(flipped) - right_to_wrong
    accuracy_base = sum(r.correct for r in base_index.values()) / n
    accuracy_cand = sum(r.correct for r in cand_index.values()) / n
    return AnswerComparison(
        questions=n,
        flips=len(flipped),
        flip_rate=len(flipped) / n,
        right_to_wrong=right_to_wrong,
        wrong_to_right=wrong_to_right,
        accuracy_base=accuracy_base,
        accuracy_cand=accuracy_cand,
        se_base=binomial_se(accuracy_base, n),
        se_cand=binomial_se(accuracy_cand, n),
        mcnemar_p=mcnemar_exact_p(right_to_wrong, wrong_to_right),
        flipped=tuple(flipped),
    )


# ---- the flip rule's uncertainty (additions to the article) -------------------


def _binomial_pmf(n: int, p: float) -> np.ndarray:
    """P(X = 0..n) for X ~ Binomial(n, p), in log space so that large n cannot overflow."""
    if p <= 0.0 or p >= 1.0:
        pmf = np.zeros(n + 1)
        pmf[0 if p <= 0.0 else n] = 1.0
        return pmf
    k = np.arange(n + 1)
    # log C(n, k) as a running sum of log((n - i + 1) / i).
    log_comb = np.concatenate(([0.0], np.cumsum(np.log(np.arange(n, 0, -1)) - np.log(np.arange(1, n + 1)))))
    return np.exp(log_comb + k * math.log(p) + (n - k) * math.log1p(-p))


def flip_ratio_p(flips: int, floor_flips: int, ratio: float, floor_passes: int = 1) -> float:
    """One-sided exact conditional binomial p-value of "candidate flips at most ``ratio`` x the floor's".

    Both counts are treated as Poisson with rates lambda_c and lambda_f per pass of the questions;
    ``floor_flips`` is summed over ``floor_passes`` noise passes, so its exposure is that many passes.
    Under H0 lambda_c = ratio * lambda_f, the candidate's share of all flips is
    c | c + f ~ Binomial(c + f, ratio / (floor_passes + ratio)); the p-value is
    P(X >= c). A small p says the candidate flips more than ``ratio`` x the floor
    beyond what the noise in both counts explains.
    """
    if min(flips, floor_flips) < 0 or ratio <= 0 or floor_passes < 1:
        raise ValueError("flip counts must be non-negative, ratio positive and floor_passes at least 1")
    total = flips + floor_flips
    if total == 0:
        return 1.0
    return float(min(1.0, _binomial_pmf(total, ratio / (floor_passes + ratio))[flips:].sum()))


def pooled_floor(pass_flips: Sequence[int], alpha: float = 0.05) -> tuple[int, int, float]:
    """The flip floor from several noise passes of the same questions (an addition): (flips, passes, p).

    Passes whose counts agree with one rate are repeated measurements of it: their flips are summed and
    tested against their summed exposure (``flip_ratio_p``'s ``floor_passes``). Whether they agree: under
    equal rates the most flipping pass's share of all flips is Binomial(total, 1/m), and p is the chance that
    some pass reaches its count (Bonferroni over the m passes). Below ``alpha`` the passes measure different
    noise (a batch-invariant engine's batch-order pass beside an FP16 one), and the worst pass alone is the
    floor, as one pass of it. One pass, or none, is its own floor (p = 1)."""
    counts = list(pass_flips)
    if min(counts, default=0) < 0:
        raise ValueError("flip counts must be non-negative")
    if len(counts) < 2:
        return (counts[0] if counts else 0), 1, 1.0
    total, worst, passes = sum(counts), max(counts), len(counts)
    p = float(min(1.0, passes * _binomial_pmf(total, 1.0 / passes)[worst:].sum())) if total else 1.0
    return (total, passes, p) if p >= alpha else (worst, 1, p)


def flip_rule_power(allowed: Callable[[int], float], floor_rate: float, cand_rate: float, questions: int,
                    floor_passes: int = 1) -> float:
    """Probability that a flip rule fails a candidate whose true flip rate is ``cand_rate``.

    ``allowed(f)`` is the rule's allowance for a floor count f summed over ``floor_passes``
    passes; the rule fails when the candidate's count exceeds it. Both counts are modelled as
    independent binomial draws (the floor's over floor_passes x questions), which is what the
    conditional test assumes.
    """
    if not (0.0 <= floor_rate <= 1.0 and 0.0 <= cand_rate <= 1.0) or questions <= 0:
        raise ValueError("rates must be fractions and questions positive")
    floor_pmf = _binomial_pmf(questions * floor_passes, floor_rate)
    cand_tail = np.cumsum(_binomial_pmf(questions, cand_rate)[::-1])[::-1]  # P(C >= c)
    power = 0.0
    for f in np.flatnonzero(floor_pmf > 1e-12):
        first_failing = math.floor(allowed(int(f))) + 1
        if first_failing <= questions:
            power += floor_pmf[f] * cand_tail[first_failing]
    return float(power)


def detectable_flip_rate(
    allowed: Callable[[int], float], floor_rate: float, questions: int, power: float = 0.8, floor_passes: int = 1
) -> float:
    """The smallest true candidate flip rate that the rule fails with probability ``power``.

    Bisection on the rate (power rises with it); ``math.inf`` when even a
    candidate that flips every question is caught less often than that.
    """
    allowed = functools.lru_cache(maxsize=None)(allowed)  # every bisection step asks for the same floors
    if flip_rule_power(allowed, floor_rate, 1.0, questions, floor_passes) < power:
        return math.inf
    low, high = floor_rate, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if flip_rule_power(allowed, floor_rate, middle, questions, floor_passes) >= power:
            high = middle
        else:
            low = middle
    return high


# ---- the accuracy rules' resolution (additions to the article) -------------------

FailsFrom = Callable[[int], int]  # discordant count D -> the fewest right-to-wrong answers of D that fail


def drop_fails_from(questions: int, margin: float, alpha: float = 1.0) -> FailsFrom:
    """An accuracy rule's failing region on paired answers: for D discordant answers, the fewest
    right-to-wrong answers b of them with a drop (2b - D)/n above ``margin`` and a one-sided exact
    McNemar p below ``alpha`` (``alpha`` >= 1: the drop alone decides, as the article's rule does with
    margin k SE). D + 1 where no b of D fails. The p-values here are floats, for the power sums."""
    def fails_from(discordant: int) -> int:
        # A hair above the half-way count, so that a drop of exactly the margin passes despite rounding.
        past_margin = max(math.floor((margin * questions + discordant) / 2 + 1e-9) + 1, 0)
        tail = np.cumsum(_binomial_pmf(discordant, 0.5)[::-1])[::-1]  # P(X >= b), X ~ Binomial(D, 1/2)
        significant = np.flatnonzero(tail < alpha)
        return max(past_margin, int(significant[0]) if significant.size else discordant + 1)
    return fails_from


def drop_power(fails_from: FailsFrom, questions: int, discordant_rate: float, drop: float) -> float:
    """Probability that an accuracy rule fails a candidate whose true accuracy is ``drop`` below the
    baseline's, exactly: right-to-wrong and wrong-to-right answers are multinomial with rates
    discordant_rate / 2 + drop and discordant_rate / 2 (the run's churn, plus the loss), so
    D ~ Binomial(n, discordant_rate + drop) and b | D ~ Binomial(D, share of right-to-wrong)."""
    wrong_to_right = discordant_rate / 2
    right_to_wrong = wrong_to_right + drop
    total = right_to_wrong + wrong_to_right
    if not (0.0 <= wrong_to_right and drop >= 0 and total <= 1.0 + 1e-9) or questions <= 0:
        raise ValueError(f"rates must be fractions summing to at most 1, got {right_to_wrong} and {wrong_to_right}")
    if total == 0:
        return 0.0
    share = right_to_wrong / total
    power = 0.0
    discordant_pmf = _binomial_pmf(questions, min(total, 1.0))  # the sum of rates may round past 1
    for d in np.flatnonzero(discordant_pmf > 1e-12):
        first = fails_from(int(d))
        if first <= d:
            power += discordant_pmf[d] * _binomial_pmf(int(d), share)[first:].sum()
    return float(power)


def detectable_drop(fails_from: FailsFrom, questions: int, discordant: int, power: float = 0.8) -> float:
    """The smallest true accuracy drop an accuracy rule fails with probability ``power``, at this run's
    churn (``discordant`` answers of ``questions``); bisection, as ``detectable_flip_rate``. ``math.inf``
    when even a drop of every answer left is caught less often than that."""
    fails_from = functools.lru_cache(maxsize=None)(fails_from)
    rate = discordant / questions
    high = 1.0 - rate
    if drop_power(fails_from, questions, rate, high) < power:
        return math.inf
    low = 0.0
    for _ in range(30):
        middle = (low + high) / 2
        if drop_power(fails_from, questions, rate, middle) >= power:
            high = middle
        else:
            low = middle
    return high


def final_answer(text: str, think_end: str | None, stops: Sequence[str]) -> tuple[str, int | None]:
    """The answer a reasoning model gave, and how many characters of thinking came before it.

    lm-eval's ``postprocess_generated_text``: with ``think_end`` set, the answer is the text after its
    last occurrence, stripped on the left; then the task's stop strings cut it. The thinking is every
    character up to the end of that marker; None when the text has none (a model that did not think, or
    one the token budget cut while thinking): lm-eval then scores the whole text, and so does the gate.
    """
    thinking = None
    if think_end:
        head, marker, tail = text.rpartition(think_end)
        if marker:
            thinking = len(head) + len(marker)
        text = tail.lstrip()
    for stop in stops:
        if stop:
            text = text.split(stop)[0]
    return text, thinking


# What lm-eval's regex filter answers when the pattern finds nothing (RegexFilter's fallback).
INVALID_ANSWER = "[invalid]"


def is_invalid(record: AnswerRecord) -> bool:
    """No parsable answer under the task's filter: lm-eval's "[invalid]", or nothing at all."""
    return record.response.strip() in ("", INVALID_ANSWER)


def invalid_rate(records: Sequence[AnswerRecord]) -> float:
    """The share of answers with no parsable answer (vLLM's gsm8k_eval reports it as invalid_rate)."""
    if not records:
        raise ComparisonError("no answers to count")
    return sum(is_invalid(record) for record in records) / len(records)


def length_drift(base: Mapping[Hashable, str], cand: Mapping[Hashable, str]) -> float:
    """mean(candidate length) / mean(baseline length) - 1 over the questions both answered,
    lengths in characters of the raw generated text (MLPerf's TEST09 bounds it at 10%)."""
    shared = [doc for doc in base if doc in cand]
    if not shared:
        raise ComparisonError("the two runs answered no question in common")
    base_total = sum(len(base[doc]) for doc in shared)
    if base_total == 0:
        raise ComparisonError("every baseline answer is empty; a length drift is undefined")
    return sum(len(cand[doc]) for doc in shared) / base_total - 1.0


@dataclass(frozen=True)
class Thinking:
    """One run's thinking on a task (addition): characters up to and including the think_end marker."""

    answers: int
    closed: int  # answers whose text has the marker; the others are scored whole (``final_answer``)
    mean_chars: float | None  # over the closed answers; None: none closed

    def text(self) -> str:
        mean = "-" if self.mean_chars is None else f"{self.mean_chars:.1f}"
        return f"mean {mean} characters of thinking, {self.closed} of {self.answers} answers closed it"


def thinking_lengths(values: Iterable[int | None | list[int | None]]) -> Thinking:
    """Summarise the per-answer thinking lengths of a run (a doc of several requests gives a list)."""
    flat: list[int | None] = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    closed = [n for n in flat if n is not None]
    return Thinking(len(flat), len(closed), sum(closed) / len(closed) if closed else None)
