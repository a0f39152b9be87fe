"""The fidelity rules' verdicts: probabilities on the same text (the corpus, and its worst position
bucket) and on generated text (the decode phase, and decode against the model's own prefill). Each puts
the candidate beside the same figure for the noise floor, and the decode-phase figures beside the
candidate's prefill figures on the corpus."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..core import rules
from ..core.budget import level_allowance
from ..core.decode_phase import DecodeComparison
from ..core.logprobs import LogprobComparison, PositionBucket
from ..core.rules import RuleOutcome
from ..errors import GateError
from ..run.record import DECODE_DUMP, ON_BASELINE_DUMP, PASS_DESCRIPTIONS, PREFILL_DUMP
from .decode_comparisons import BASELINE_GAP
from .fidelity_notes import candidate_noise_notes, kl_notes, positions_note, reference_notes
from .judging import Judging
from .probability_limits import bounded, limit_shown
from .recompute import compare_logprobs_command, fp8gate_command
from .verdict import Case, Verdict, number

SIDE_BY_SIDE = "side_by_side"  # the verdict's details key holding the decode/prefill line of the report


def probability(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """A probability rule on the corpus: the candidate's figure against the limit and the worst noise pass's."""
    spec = judging.config.probabilities
    assert spec is not None
    limits = spec.limits
    comparison = judging.comparisons.logprobs(case.candidate)
    floors = judging.comparisons.logprob_floors()
    k = level_allowance(judging.level, limits.limit_se)
    outcome, floor_values = bounded(judging, rule, rule.name, comparison, floors, k)
    notes = [rules.sanity_floor_note(comparison.same_top)] if outcome.bound_by == rules.SANITY_FLOOR else []
    notes += [f"noise pass {label}: {rule.name} = {number(v)} ({PASS_DESCRIPTIONS[label]})"
              for label, v in floor_values.items()]
    if case.rule == "mean_kl":
        notes += kl_notes(judging, comparison, spec.top_k)
    if k > 0:
        notes.append(f"judged like accuracy: fails only when the limit is missed by more than "
                     f"{k:.3g} SE of the worst noise pass's figure, what a build with no real change shows ("
                     + ("limit_se, an addition; 0 judges the point estimate)" if judging.level is None
                        else "the run's false-alarm budget sets it, an addition)"))
    assert rule.ideal is not None
    notes += reference_notes(judging, rule.name, comparison, rule.ideal, floors)
    notes += candidate_noise_notes(judging, case.candidate)
    notes.append(positions_note(spec.chunk_tokens, comparison, rule.name, getattr(limits, rule.limit_key) is not None,
                                rule.limit_key))
    notes.append(f"{comparison.positions} positions; same top {comparison.same_top:.5f} "
                 f"± {comparison.same_top_se:.5f}, RMS Δp {comparison.rms_dp:.5f}, "
                 f"PPL ratio {comparison.ppl_ratio:.6f}")
    return _probability_verdict(judging, case, rule.name, outcome, comparison, floors, tuple(notes))


def bucket(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """A probability rule on its worst position bucket, each bucket against the noise floor's same bucket
    (an addition); a bucket with fewer than min_bucket_positions positions is shown, not judged."""
    spec = judging.config.probabilities
    assert spec is not None and spec.limits.per_bucket  # collected only where per_bucket is set
    metric = rule.name.removeprefix(rules.BUCKET_PREFIX)
    comparison = judging.comparisons.logprobs(case.candidate)
    floors = judging.comparisons.logprob_floors()
    judged: list[tuple[PositionBucket, RuleOutcome]] = []
    notes = []
    # The worst of B judged buckets is B tests: the rule's level is split among them (Bonferroni).
    judgeable = sum(b.comparison.positions >= spec.min_bucket_positions for b in comparison.buckets)
    level = judging.level
    k = level_allowance(None if level is None else level / max(judgeable, 1), spec.limits.limit_se)
    for each in comparison.buckets:
        n = each.comparison.positions
        if n < spec.min_bucket_positions:
            notes.append(f"bucket {each.label}: {n} positions, {metric} = "
                         f"{number(getattr(each.comparison, metric))}; not judged (fewer than "
                         f"probabilities.min_bucket_positions = {spec.min_bucket_positions})")
            continue
        same = {label: c for label, floor in floors.items() if (c := floor.bucket(each.label)) is not None}
        outcome, floor_values = bounded(judging, rule, metric, each.comparison, same, k, each.label)
        judged.append((each, outcome))
        worst_floor = "; ".join(f"{label} {number(v)}" for label, v in floor_values.items()) or "none"
        notes.append(f"bucket {each.label}: {n} positions, {metric} = {number(outcome.measured)} "
                     f"(noise floor: {worst_floor}), margin {outcome.margin:+.6g}")
    if not judged:
        shown = ", ".join(f"{b.label}: {b.comparison.positions}" for b in comparison.buckets)
        raise GateError(f"{judging.config.path}: probabilities.min_bucket_positions: no position bucket holds "
                        f"{spec.min_bucket_positions} scored positions ({shown}); lower it, or score more "
                        "chunks or longer ones")
    worst, outcome = min(judged, key=lambda pair: pair[1].margin)
    whole = getattr(comparison, metric)
    # The worst bucket's p over the B buckets judged (Bonferroni), so the budget sees one test.
    p_value = min(1.0, min(o.figures["p_value"] for _, o in judged) * len(judged))
    outcome = dataclasses.replace(
        outcome, rows=(("bucket start", worst.start), ("bucket positions", worst.comparison.positions),
                       ("whole chunk", whole), *outcome.rows),
        figures={**outcome.figures, "bucket_start": worst.start, "whole_chunk": whole, "p_value": p_value})
    notes.insert(0, f"worst bucket {worst.label} (token positions in each sequence); whole chunk "
                    f"{metric} = {number(whole)} over {comparison.positions} positions")
    return _probability_verdict(judging, case, metric, outcome, comparison, floors, tuple(notes),
                                {"bucket": worst.label}, (spec.chunk_tokens, spec.bucket_edges))


def _probability_verdict(judging: Judging, case: Case, metric: str, outcome: RuleOutcome,
                         comparison: LogprobComparison, floors: Mapping[str, LogprobComparison],
                         notes: tuple[str, ...], extra: Mapping[str, Any] | None = None,
                         buckets: tuple[int, Sequence[int]] | None = None) -> Verdict:
    details = {"comparison": comparison.as_dict(),
               "noise_floor": {label: c.as_dict() for label, c in floors.items()}, **(extra or {})}
    recompute = compare_logprobs_command(judging.comparisons.baseline().main,
                                         judging.records.candidate(case.candidate).main, buckets)
    return Verdict(case, outcome, details, notes, limit=limit_shown(judging, metric, outcome), recompute=recompute)


def decode(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """A decode rule: the probability rules on generated positions share one verdict, driven by their row
    (its bound); the gap between decode and the model's own prefill has its own."""
    return decode_phase(judging, case, rule) if rule.bound is not None else decode_gap(judging, case, rule)


def decode_phase(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """decode_same_top, decode_rms_dp, decode_mean_kl: the probability rules' judgement on generated positions;
    the level: the rule's share of the run's false-alarm budget (None: decode.limits.limit_se decides)."""
    config, comparisons = judging.config, judging.comparisons
    spec = config.decode
    assert spec is not None
    limits = spec.limits
    metric = rule.name.removeprefix(rules.DECODE_PREFIX)
    comparison, floors = comparisons.decoded.decode(case.candidate)
    if getattr(comparison.logprobs, metric) is None:
        raise GateError(f"{config.path}: decode.limits.{rule.limit_key}: the engine gave no distributions to "
                        f"compute {metric} from (KL: {comparison.logprobs.kl_kind})")
    reference = getattr(limits, rule.limit_key)
    outcome, floor_values = rule.against_floors(metric, comparison.logprobs, {k: c.logprobs for k, c in floors.items()},
                                                reference, limits.floor_ratio, "floor_ratio",
                                                level_allowance(judging.level, limits.limit_se))
    prefill = _prefill_line(judging, case.candidate)
    notes = [rules.sanity_floor_note(comparison.logprobs.same_top)] if outcome.bound_by == rules.SANITY_FLOOR else []
    notes += [f"on {comparison.logprobs.positions} generated positions ({comparison.sequences} greedy continuations "
              f"of {spec.new_tokens} tokens the baseline wrote after {spec.prompt_tokens}-token corpus prompts; "
              "the candidate prefilled the exact ids)",
              f"decode phase: {_figures(comparison)}"]
    if prefill:
        notes.append(f"prefill on the corpus: {prefill}")
    notes += [f"floor {label}: {metric} = {v:.6g}" for label, v in floor_values.items()]
    notes += candidate_noise_notes(judging, case.candidate)
    side = f"decode {_figures(comparison)}" + (f" | prefill {prefill}" if prefill else "")
    details = {"comparison": comparison.as_dict(), "noise_floor": {k: c.as_dict() for k, c in floors.items()},
               SIDE_BY_SIDE: side}
    value = limits.floor_ratio if outcome.limit_key == "floor_ratio" else reference
    assert value is not None  # the floor ratio bound only where it is set
    base_decode, cand_decode = comparisons.baseline().decode, judging.records.candidate(case.candidate).decode
    assert base_decode is not None and cand_decode is not None  # compared above
    recompute = _recompute(base_decode.dumps.get(DECODE_DUMP), cand_decode.dumps.get(ON_BASELINE_DUMP))
    return Verdict(case, outcome, details, tuple(notes),
                   limit=judging.limit(f"decode.limits.{outcome.limit_key}", value), recompute=recompute)


def decode_gap(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """The candidate's decode-time log-probs against its prefill of the same ids, within max_gap_kl or
    gap_ratio x the baseline's own gap (not zero on GPUs)."""
    config = judging.config
    assert config.decode is not None
    limits = config.decode.limits
    assert limits.max_gap_kl is not None  # the rule is collected only where it is set
    decoded = judging.comparisons.decoded
    cand, base = decoded.decode_gap(case.candidate), decoded.baseline_gap()
    if cand.mean_kl is None or base.mean_kl is None:
        raise GateError(f"{config.path}: decode.limits.max_gap_kl: the engine gave no distributions to "
                        f"compute KL from (KL: {cand.logprobs.kl_kind})")
    outcome = rules.at_most_or_floor(rules.DECODE_GAP, cand.mean_kl, limits.max_gap_kl, base.mean_kl,
                                     limits.gap_ratio, measured_se=base.logprobs.kl_se or 0.0,
                                     k_se=level_allowance(judging.level, limits.limit_se),
                                     keys=("max_gap_kl", "gap_ratio"))
    notes = [f"candidate decode vs its own prefill: {_figures(cand)}",
             f"baseline decode vs its own prefill (noise floor): {_figures(base)}",
             "KL(decode || prefill) on each model's own greedy continuations; a KV-cache path that prefill-only "
             "scoring cannot see (an FP8 KV cache) shows here"]
    details = {"comparison": cand.as_dict(), "noise_floor": {BASELINE_GAP: base.as_dict()},
               SIDE_BY_SIDE: f"decode vs prefill: candidate KL {cand.mean_kl:.6g}, baseline KL {base.mean_kl:.6g}"}
    result = judging.records.candidate(case.candidate).decode
    assert result is not None  # compared above
    return Verdict(case, outcome, details, tuple(notes),
                   limit=judging.limit(f"decode.limits.{outcome.limit_key}", getattr(limits, outcome.limit_key)),
                   recompute=_recompute(result.dumps.get(DECODE_DUMP), result.dumps.get(PREFILL_DUMP)))


def _figures(comparison: DecodeComparison) -> str:
    c = comparison.logprobs
    kl = "-" if c.mean_kl is None else f"{c.mean_kl:.6g}"
    reverse = "-" if comparison.mean_reverse_kl is None else f"{comparison.mean_reverse_kl:.6g}"
    acceptance = "-" if comparison.acceptance_rate is None else f"{comparison.acceptance_rate:.5f}"
    return (f"same top {c.same_top:.5f}, RMS Δp {c.rms_dp:.5f}, KL {kl} ({c.kl_kind}); additions: reverse KL "
            f"{reverse} ({comparison.reverse_kl_kind}), acceptance Σmin(p,q) {acceptance} "
            f"({comparison.acceptance_kind}); greedy choice departs in {comparison.departed} of "
            f"{comparison.sequences} continuations, first at {comparison.mean_first_departure:.1f} on average "
            f"(censored at the length)")


def _prefill_line(judging: Judging, candidate: str) -> str | None:
    """The candidate's prefill figures on the corpus (the probability check's own comparison), when measured."""
    comparisons = judging.comparisons
    if comparisons.baseline().main.logprobs is None or judging.records.candidate(candidate).main.logprobs is None:
        return None
    c = comparisons.logprobs(candidate)
    kl = "-" if c.mean_kl is None else f"{c.mean_kl:.6g}"
    return f"same top {c.same_top:.5f}, RMS Δp {c.rms_dp:.5f}, KL {kl} ({c.kl_kind})"


def _recompute(first: Path | None, second: Path | None) -> str | None:
    """``fp8gate compare-logprobs`` on two decode-phase dumps (None: one was not written)."""
    return fp8gate_command("compare-logprobs", first, second) if first is not None and second is not None else None
