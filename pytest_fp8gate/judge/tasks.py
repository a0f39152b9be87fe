"""The task rules' verdicts, on the answers lm-eval scored: accuracy (the article's and the paired
addition), flips, recovery, and the answers' form (length drift, invalid rate, truncation). Each puts
the candidate beside the noise passes' own figures, and names the setting that bound."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..config.spec import TaskSpec
from ..core import rules
from ..core.answers import AnswerComparison, pooled_floor
from ..core.budget import level_allowance
from ..run.record import PASS_DESCRIPTIONS
from .answer_checks import answer_comparison
from .flip_notes import flip_examples, flip_floor_notes, flip_rule_note
from .judging import Judging, VerdictFunction
from .recompute import flips_command
from .verdict import Case, Verdict

THINKING = "thinking"  # the details key of the answers' rules holding the thinking lengths (think_end set)


def verdict(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """A task rule's verdict: each rule of the kind reads its own evidence (VERDICTS)."""
    return VERDICTS[rule.name](judging, case, rule)


def accuracy(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    task = judging.task(case)
    comparison, floors = answer_comparison(judging, case)
    outcome = rules.accuracy_within_se(comparison.accuracy_base, comparison.accuracy_cand, comparison.questions,
                                       k=task.limits.accuracy_se, two_sided=task.limits.two_sided,
                                       discordant=comparison.flips)
    notes = [f"SE = sqrt(p(1-p)/n) with p the baseline accuracy; k = {task.limits.accuracy_se:g}"
             f"{', two-sided' if task.limits.two_sided else ', one-sided (a drop fails)'}",
             f"McNemar exact p on the flips: {comparison.mcnemar_p:.4g} (an addition to the article)"]
    notes += [f"noise pass {label}: accuracy {c.accuracy_cand:.4f}" for label, c in floors.items()]
    return _answers_verdict(judging, case, task, outcome, comparison, floors, notes)


def paired_accuracy(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    task, level = judging.task(case), judging.level
    limits = task.limits
    comparison, floors = answer_comparison(judging, case)
    outcome = rules.paired_accuracy_within(comparison.right_to_wrong, comparison.wrong_to_right, comparison.questions,
                                           margin=limits.accuracy_margin,
                                           alpha=limits.accuracy_alpha if level is None else level)
    figures = outcome.figures
    notes = [f"an addition beside the article's accuracy rule: fails when the drop "
             f"({comparison.accuracy_base:.4f} -> {comparison.accuracy_cand:.4f}) is larger than "
             f"{limits.accuracy_margin:g} (tasks.limits.accuracy_margin) and the one-sided exact McNemar "
             f"test on the {figures['discordant']:g} changed answers gives p < "
             + (f"{limits.accuracy_alpha:g} (tasks.limits.accuracy_alpha)" if level is None
                else f"{level:.3g} (its share of run_alpha)")
             + f": p = {figures['p_value']:.4g}, paired SE "
             f"{figures['paired_se']:.4g}",
             f"resolution at {comparison.questions} questions and this run's {figures['discordant']:g} changed "
             f"answers: a true drop of {figures['resolution']:.4g} is caught with {rules.DETECTION_POWER:.0%} "
             "power; a pass does not rule out a smaller one"]
    notes += [f"noise pass {label}: {c.right_to_wrong} right->wrong, {c.wrong_to_right} wrong->right"
              for label, c in floors.items()]
    return _answers_verdict(judging, case, task, outcome, comparison, floors, notes)


def recovery(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    task, level = judging.task(case), judging.level
    min_recovery = task.limits.min_recovery
    assert min_recovery is not None  # the rule is collected only where it is set
    comparison, floors = answer_comparison(judging, case)
    both_right = comparison.accuracy_base - comparison.right_to_wrong / comparison.questions
    k = level_allowance(level, task.limits.accuracy_se)
    outcome = rules.recovery_within(comparison.accuracy_base, comparison.accuracy_cand, both_right,
                                    comparison.questions, min_recovery, k=k)
    se = outcome.figures["recovery_se"]
    notes = [f"recovery = candidate / baseline accuracy = {outcome.measured:.4f}, 95% interval "
             f"[{outcome.measured - 1.96 * se:.4f}, {outcome.measured + 1.96 * se:.4f}] by the delta method on "
             f"the {comparison.questions} paired answers (an addition); fails when recovery + "
             f"{k:.3g} SE ({'tasks.limits.accuracy_se' if level is None else 'its share of run_alpha'}) "
             f"< {min_recovery:g}, beside the accuracy rule, not instead of it",
             "llm-compressor's tests pass a point recovery >= recovery_threshold (0.95, 0.94 for NVFP4) per "
             "metric; MLPerf asks 99% of the reference"]
    notes += [f"noise pass {label}: recovery {c.accuracy_cand / c.accuracy_base:.4f}" for label, c in floors.items()]
    return _answers_verdict(judging, case, task, outcome, comparison, floors, notes)


def flips(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    task, level = judging.task(case), judging.level
    comparison, floors = answer_comparison(judging, case)
    # Noise passes that agree are repeated measurements of one floor (an addition): their flips summed and
    # tested against their summed exposure, so a further pass sharpens the floor; passes that disagree
    # measure different noise, and the worst alone is the floor.
    floor_flips, passes, agree_p = pooled_floor([c.flips for c in floors.values()])
    limits = task.limits
    outcome = rules.flips_within_noise_floor(comparison.flips, floor_flips, comparison.questions,
                                             ratio=limits.flips_ratio, min_allowance_fraction=limits.min_flip_allowance,
                                             rule=limits.flip_rule,
                                             alpha=limits.flip_alpha if level is None else level, floor_passes=passes)
    notes = [f"candidate flips: {comparison.right_to_wrong} right->wrong, {comparison.wrong_to_right} "
             f"wrong->right; accuracy {comparison.accuracy_base:.4f} -> {comparison.accuracy_cand:.4f}; "
             f"McNemar exact p {comparison.mcnemar_p:.4g}",
             flip_rule_note(limits, outcome, comparison.questions, level)]
    notes += [f"noise pass {label}: {c.flips} flip{'' if c.flips == 1 else 's'} ({PASS_DESCRIPTIONS[label]})"
              for label, c in floors.items()]
    notes += flip_floor_notes(limits, len(floors), floor_flips, passes, agree_p, comparison.questions)
    return _answers_verdict(judging, case, task, outcome, comparison, floors, notes, flip_examples(comparison))


def _answers_verdict(judging: Judging, case: Case, task: TaskSpec, outcome: rules.RuleOutcome,
                     comparison: AnswerComparison, floors: dict[str, AnswerComparison], notes: list[str],
                     examples: tuple[str, ...] = ()) -> Verdict:
    """A verdict on the paired answers: both comparisons in its details, and fp8gate flips to recompute it."""
    summary = {k: v for k, v in comparison.as_dict().items() if k != "flipped"}
    summary["flipped_doc_ids"] = [str(f.doc_id) for f in comparison.flipped]
    details = {"comparison": summary,
               "noise_floor": {label: {k: v for k, v in c.as_dict().items() if k != "flipped"}
                               for label, c in floors.items()}}
    recompute = flips_command(judging.comparisons.baseline().main, judging.records.candidate(case.candidate).main,
                              task)
    return Verdict(case, outcome, details, tuple(notes), examples,
                   limit=judging.task_limit(task, outcome.limit_key, getattr(task.limits, outcome.limit_key)),
                   recompute=recompute)


def _thinking(judging: Judging, task: TaskSpec, case: Case) -> tuple[list[str], dict[str, Any]]:
    """With think_end set: the notes and details that put the thinking lengths beside an answers' rule,
    which judges the answers after the marker only."""
    if task.think_end is None:
        return [], {}
    found = judging.comparisons.thinking(case.candidate, task)
    notes = [f"judged on the answers after the last {task.think_end!r} (the thinking before it is not scored); "
             + "; ".join(f"{who}: {thinking.text()}" for who, thinking in found.items())]
    return notes, {THINKING: {who: asdict(thinking) for who, thinking in found.items()}}


def length_drift(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """Mean output length against the baseline's, next to the noise passes' own drift."""
    task = judging.task(case)
    max_drift = task.limits.max_length_drift
    assert max_drift is not None  # the rule is collected only where it is set
    drift, floors = judging.comparisons.length_drifts(case.candidate, task)
    worst = max(floors.values(), key=abs) if floors else None
    outcome = rules.length_drift_within(drift, worst, max_drift, task.limits.flips_ratio)
    what = "answers after the thinking" if task.think_end else "raw generations"
    notes = [f"mean length of the {what} in characters: candidate {drift:+.2%} against the baseline "
             f"(MLPerf TEST09 bounds it at ±10%)"]
    notes += [f"noise pass {label}: {d:+.2%}" for label, d in floors.items()]
    thinking_notes, thinking = _thinking(judging, task, case)
    return Verdict(case, outcome, {"drift": drift, "noise_floor": floors, **thinking}, tuple(notes + thinking_notes),
                   limit=judging.task_limit(task, outcome.limit_key, getattr(task.limits, outcome.limit_key)))


def invalid_rate(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """The share of answers with nothing parsable under the task's filter, against the baseline's."""
    task = judging.task(case)
    max_increase = task.limits.max_invalid_increase
    assert max_increase is not None  # the rule is collected only where it is set
    base_rate, cand_rate, floors, questions = judging.comparisons.invalid_rates(case.candidate, task)
    outcome = rules.invalid_rate_within(base_rate, cand_rate, max(floors.values()) if floors else None, questions,
                                        max_increase, level_allowance(judging.level, task.limits.accuracy_se))
    notes = [f"invalid: no answer under filter {task.filter!r} (lm-eval's \"[invalid]\" or empty); baseline "
             f"{base_rate:.4f}, candidate {cand_rate:.4f}"]
    notes += [f"noise pass {label}: {r:.4f}" for label, r in floors.items()]
    if outcome.bound_by is not None:
        notes.append(f"the allowed rise is the {outcome.bound_by}'s own rise, above max_invalid_increase")
    thinking_notes, thinking = _thinking(judging, task, case)
    return Verdict(case, outcome, {"baseline": base_rate, "candidate": cand_rate, "noise_floor": floors, **thinking},
                   tuple(notes + thinking_notes),
                   limit=judging.task_limit(task, outcome.limit_key, max_increase))


def truncation(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """The share of answers the token budget ended (finish_reason "length"), against the baseline's."""
    task = judging.task(case)
    max_increase = task.limits.max_truncation_increase
    assert max_increase is not None  # the rule is collected only where it is set
    base, cand, floors, questions = judging.comparisons.truncations(case.candidate, task)
    worst = max((len(cut) / questions for cut in floors.values()), default=None)
    outcome = rules.truncation_within(len(base) / questions, len(cand) / questions, worst, questions, max_increase,
                                      level_allowance(judging.level, task.limits.accuracy_se), len(cand - base),
                                      len(base - cand))
    budget = f"max_gen_toks = {task.max_gen_toks}" if task.max_gen_toks else "the task's max_gen_toks"
    notes = [f"answers ended by the token budget ({budget}; vLLM's finish_reason \"length\"): baseline "
             f"{len(base)} of {questions}, candidate {len(cand)} ({len(cand - base)} cut in the candidate only); "
             "a cut answer is scored as written, so an answer that grew past the budget reads as wrong"
             + (f" (one cut inside its thinking has no {task.think_end!r} and is scored whole, as lm-eval does)"
                if task.think_end else "")]
    notes += [f"noise pass {label}: {len(cut)} cut" for label, cut in floors.items()]
    if outcome.bound_by is not None:
        notes.append(f"the allowed rise is the {outcome.bound_by}'s own rise, above max_truncation_increase")
    thinking_notes, thinking = _thinking(judging, task, case)
    examples = tuple(f"    doc {doc}: cut in the candidate, not in the baseline"
                     for doc in sorted(cand - base, key=str)[:5])
    return Verdict(case, outcome, {"baseline_cut": len(base), "candidate_cut": len(cand), "questions": questions,
                                   "noise_floor": {label: len(cut) for label, cut in floors.items()}, **thinking},
                   tuple(notes + thinking_notes), examples,
                   limit=judging.task_limit(task, outcome.limit_key, max_increase))


VERDICTS: dict[str, VerdictFunction] = {
    rules.ACCURACY: accuracy, rules.PAIRED_ACCURACY: paired_accuracy, rules.FLIPS: flips,
    rules.RECOVERY: recovery, rules.LENGTH_DRIFT: length_drift, rules.INVALID_RATE: invalid_rate,
    rules.TRUNCATION: truncation}
