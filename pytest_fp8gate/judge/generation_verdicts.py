"""Verdicts of the rules on generated text: the decode phase, decode against prefill, and the
answers' length and validity. Each puts the candidate beside the same figure for the noise floor,
and the decode-phase figures beside the candidate's prefill figures on the corpus.

The evidence comes from ``Comparisons`` (computed once, shared with the probability verdicts and
the report); the rule rows in ``rules.RULES`` decide (``bound`` or ``judge``), and each outcome's
``limit_key`` names the setting that bound.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config.spec import TaskSpec
from ..core import rules
from ..core.budget import level_allowance
from ..core.decode_phase import DecodeComparison
from ..core.logprobs import LogprobComparison
from ..errors import GateError
from ..run.record import DECODE_DUMP, ON_BASELINE_DUMP, PREFILL_DUMP
from .comparisons import BASELINE_GAP, Comparisons
from .recompute import fp8gate_command
from .verdict import Case, Verdict, limit_setting

SIDE_BY_SIDE = "side_by_side"  # the verdict's details key holding the decode/prefill line of the report
THINKING = "thinking"  # the details key of the answers' rules holding the thinking lengths (think_end set)


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


def _prefill_line(comparisons: Comparisons, candidate: str) -> str | None:
    """The candidate's prefill figures on the corpus (the probability check's own comparison), when measured."""
    if comparisons.baseline().main.logprobs is None or comparisons.records.candidate(candidate).main.logprobs is None:
        return None
    c = comparisons.logprobs(candidate)
    kl = "-" if c.mean_kl is None else f"{c.mean_kl:.6g}"
    return f"same top {c.same_top:.5f}, RMS Δp {c.rms_dp:.5f}, KL {kl} ({c.kl_kind})"


def _recompute(first: Path | None, second: Path | None) -> str | None:
    """``fp8gate compare-logprobs`` on two decode-phase dumps (None: one was not written)."""
    return fp8gate_command("compare-logprobs", first, second) if first is not None and second is not None else None


def decode_phase(comparisons: Comparisons, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
    """decode_same_top, decode_rms_dp, decode_mean_kl: the probability rules' judgement on generated positions;
    ``level``: the rule's share of the run's false-alarm budget (None: decode.limits.limit_se decides)."""
    config = comparisons.config
    decode = config.decode
    assert decode is not None
    limits = decode.limits
    metric = rule.name.removeprefix(rules.DECODE_PREFIX)
    comparison, floors = comparisons.decode(case.candidate)
    if getattr(comparison.logprobs, metric) is None:
        raise GateError(f"{config.path}: decode.limits.{rule.limit_key}: the engine gave no distributions to "
                        f"compute {metric} from (KL: {comparison.logprobs.kl_kind})")
    reference = getattr(limits, rule.limit_key)
    same_top = comparison.logprobs.same_top
    outcome, floor_values = rule.against_floors(metric, comparison.logprobs, {k: c.logprobs for k, c in floors.items()},
                                                reference, limits.floor_ratio, "floor_ratio",
                                                level_allowance(level, limits.limit_se))
    prefill = _prefill_line(comparisons, case.candidate)
    notes = [rules.sanity_floor_note(same_top)] if outcome.bound_by == rules.SANITY_FLOOR else []
    notes += [f"on {comparison.logprobs.positions} generated positions ({comparison.sequences} greedy continuations "
             f"of {decode.new_tokens} tokens the baseline wrote after {decode.prompt_tokens}-token corpus prompts; "
             "the candidate prefilled the exact ids)",
             f"decode phase: {_figures(comparison)}"]
    if prefill:
        notes.append(f"prefill on the corpus: {prefill}")
    notes += [f"floor {label}: {metric} = {v:.6g}" for label, v in floor_values.items()]
    notes += candidate_noise_notes(comparisons, case.candidate)
    side = f"decode {_figures(comparison)}" + (f" | prefill {prefill}" if prefill else "")
    details = {"comparison": comparison.as_dict(), "noise_floor": {k: c.as_dict() for k, c in floors.items()},
               SIDE_BY_SIDE: side}
    value = limits.floor_ratio if outcome.limit_key == "floor_ratio" else reference
    assert value is not None  # the floor ratio bound only where it is set
    base_decode, cand_decode = comparisons.baseline().decode, comparisons.records.candidate(case.candidate).decode
    assert base_decode is not None and cand_decode is not None  # compared above
    recompute = _recompute(base_decode.dumps.get(DECODE_DUMP), cand_decode.dumps.get(ON_BASELINE_DUMP))
    return Verdict(case, outcome, details, tuple(notes),
                   limit=limit_setting(config, f"decode.limits.{outcome.limit_key}", value), recompute=recompute)


def decode_gap(comparisons: Comparisons, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
    """The candidate's decode-time log-probs against its prefill of the same ids, within max_gap_kl or
    gap_ratio x the baseline's own gap (not zero on GPUs)."""
    config = comparisons.config
    assert config.decode is not None
    limits = config.decode.limits
    assert limits.max_gap_kl is not None  # the rule is collected only where it is set
    cand, base = comparisons.decode_gap(case.candidate), comparisons.baseline_gap()
    if cand.mean_kl is None or base.mean_kl is None:
        raise GateError(f"{config.path}: decode.limits.max_gap_kl: the engine gave no distributions to "
                        f"compute KL from (KL: {cand.logprobs.kl_kind})")
    outcome = rule.decide(rules.DECODE_GAP, cand.mean_kl, limits.max_gap_kl, base.mean_kl, limits.gap_ratio,
                    measured_se=base.logprobs.kl_se or 0.0, k_se=level_allowance(level, limits.limit_se),
                    keys=("max_gap_kl", "gap_ratio"))
    notes = [f"candidate decode vs its own prefill: {_figures(cand)}",
             f"baseline decode vs its own prefill (noise floor): {_figures(base)}",
             "KL(decode || prefill) on each model's own greedy continuations; a KV-cache path that prefill-only "
             "scoring cannot see (an FP8 KV cache) shows here"]
    details = {"comparison": cand.as_dict(), "noise_floor": {BASELINE_GAP: base.as_dict()},
               SIDE_BY_SIDE: f"decode vs prefill: candidate KL {cand.mean_kl:.6g}, baseline KL {base.mean_kl:.6g}"}
    decode = comparisons.records.candidate(case.candidate).decode
    assert decode is not None  # compared above
    dumps = decode.dumps
    return Verdict(case, outcome, details, tuple(notes),
                   limit=limit_setting(config, f"decode.limits.{outcome.limit_key}",
                                       getattr(limits, outcome.limit_key)),
                   recompute=_recompute(dumps.get(DECODE_DUMP), dumps.get(PREFILL_DUMP)))


def _task_limit(comparisons: Comparisons, task: TaskSpec, key: str, value: float) -> str:
    return limit_setting(comparisons.config, f"tasks[{comparisons.config.tasks.index(task)}].limits.{key}", value)


def _thinking(comparisons: Comparisons, task: TaskSpec, case: Case) -> tuple[list[str], dict[str, Any]]:
    """With think_end set: the notes and details that put the thinking lengths beside an answers' rule,
    which judges the answers after the marker only."""
    if task.think_end is None:
        return [], {}
    found = comparisons.thinking(case.candidate, task)
    notes = [f"judged on the answers after the last {task.think_end!r} (the thinking before it is not scored); "
             + "; ".join(f"{who}: {thinking.text()}" for who, thinking in found.items())]
    return notes, {THINKING: {who: asdict(thinking) for who, thinking in found.items()}}


def length_drift_verdict(comparisons: Comparisons, task: TaskSpec, case: Case, rule: rules.Rule) -> Verdict:
    """Mean output length against the baseline's, next to the noise passes' own drift."""
    max_drift = task.limits.max_length_drift
    assert max_drift is not None  # the rule is collected only where it is set
    drift, floors = comparisons.length_drifts(case.candidate, task)
    worst = max(floors.values(), key=abs) if floors else None
    outcome = rule.decide(drift, worst, max_drift, task.limits.flips_ratio)
    what = "answers after the thinking" if task.think_end else "raw generations"
    notes = [f"mean length of the {what} in characters: candidate {drift:+.2%} against the baseline "
             f"(MLPerf TEST09 bounds it at ±10%)"]
    notes += [f"noise pass {label}: {d:+.2%}" for label, d in floors.items()]
    thinking_notes, thinking = _thinking(comparisons, task, case)
    return Verdict(case, outcome, {"drift": drift, "noise_floor": floors, **thinking}, tuple(notes + thinking_notes),
                   limit=_task_limit(comparisons, task, outcome.limit_key, getattr(task.limits, outcome.limit_key)))


def invalid_rate_verdict(comparisons: Comparisons, task: TaskSpec, case: Case, rule: rules.Rule,
                         level: float | None = None) -> Verdict:
    """The share of answers with nothing parsable under the task's filter, against the baseline's."""
    max_increase = task.limits.max_invalid_increase
    assert max_increase is not None  # the rule is collected only where it is set
    base_rate, cand_rate, floors, questions = comparisons.invalid_rates(case.candidate, task)
    outcome = rule.decide(base_rate, cand_rate, max(floors.values()) if floors else None, questions, max_increase,
                          level_allowance(level, task.limits.accuracy_se))
    notes = [f"invalid: no answer under filter {task.filter!r} (lm-eval's \"[invalid]\" or empty); baseline "
             f"{base_rate:.4f}, candidate {cand_rate:.4f}"]
    notes += [f"noise pass {label}: {r:.4f}" for label, r in floors.items()]
    if outcome.bound_by is not None:
        notes.append(f"the allowed rise is the {outcome.bound_by}'s own rise, above max_invalid_increase")
    thinking_notes, thinking = _thinking(comparisons, task, case)
    return Verdict(case, outcome, {"baseline": base_rate, "candidate": cand_rate, "noise_floor": floors, **thinking},
                   tuple(notes + thinking_notes), limit=_task_limit(comparisons, task, outcome.limit_key, max_increase))


def truncation_verdict(comparisons: Comparisons, task: TaskSpec, case: Case, rule: rules.Rule,
                       level: float | None = None) -> Verdict:
    """The share of answers the token budget ended (finish_reason "length"), against the baseline's."""
    max_increase = task.limits.max_truncation_increase
    assert max_increase is not None  # the rule is collected only where it is set
    base, cand, floors, questions = comparisons.truncations(case.candidate, task)
    worst = max((len(cut) / questions for cut in floors.values()), default=None)
    outcome = rule.decide(len(base) / questions, len(cand) / questions, worst, questions, max_increase,
                          level_allowance(level, task.limits.accuracy_se), len(cand - base), len(base - cand))
    budget = f"max_gen_toks = {task.max_gen_toks}" if task.max_gen_toks else "the task's max_gen_toks"
    notes = [f"answers ended by the token budget ({budget}; vLLM's finish_reason \"length\"): baseline "
             f"{len(base)} of {questions}, candidate {len(cand)} ({len(cand - base)} cut in the candidate only); "
             "a cut answer is scored as written, so an answer that grew past the budget reads as wrong"
             + (f" (one cut inside its thinking has no {task.think_end!r} and is scored whole, as lm-eval does)"
                if task.think_end else "")]
    notes += [f"noise pass {label}: {len(cut)} cut" for label, cut in floors.items()]
    if outcome.bound_by is not None:
        notes.append(f"the allowed rise is the {outcome.bound_by}'s own rise, above max_truncation_increase")
    thinking_notes, thinking = _thinking(comparisons, task, case)
    examples = tuple(f"    doc {doc}: cut in the candidate, not in the baseline"
                     for doc in sorted(cand - base, key=str)[:5])
    return Verdict(case, outcome, {"baseline_cut": len(base), "candidate_cut": len(cand), "questions": questions,
                                   "noise_floor": {label: len(cut) for label, cut in floors.items()}, **thinking},
                   tuple(notes + thinking_notes), examples,
                   limit=_task_limit(comparisons, task, outcome.limit_key, max_increase))


def candidate_noise_notes(comparisons: Comparisons, candidate: str) -> list[str]:
    """The candidate against itself in another batch order ([noise] candidate_passes), beside the baseline's floor."""
    floors: dict[str, LogprobComparison] = {}
    own = comparisons.candidate_noise(candidate)
    if own and comparisons.baseline().main.logprobs is not None:
        floors = comparisons.logprob_floors()
    notes = []
    for label, mine in own.items():
        line = f"candidate noise pass {label}: same top {mine.same_top:.5f}, KL {mine.mean_kl}"
        if label in floors:
            theirs = floors[label]
            line += f" (the baseline's own: same top {theirs.same_top:.5f}, KL {theirs.mean_kl})"
        notes.append(line)
    return notes

