"""Turn measurements into rule verdicts that explain themselves.

Each verdict puts baseline, noise floor, candidate, threshold and margin side
by side; the flip rule also shows the first flipped questions. It ends with
where to act: the thresholds key of the limit, and the ``fp8gate`` command that
recomputes the number from this run's artifacts.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import generation_verdicts, roofline, rules
from .answers import AnswerComparison, AnswerRecord, compare_answers
from .errors import ComparisonError, DumpFormatError, GateError, RooflineError
from .logprobs import TOPK_KL, LogprobComparison, compare_logprobs
from .measure import PASS_DESCRIPTIONS, Measurements, ModelResult, PassResult, memory_bandwidth, weights_dir
from .options import display_path
from .rules import RuleOutcome
from .spec import GateConfig, SpeedSpec, TaskLimits, TaskSpec

FLIP_EXAMPLES = 3


@dataclass(frozen=True)
class Case:
    """One parametrized rule test: a rule, a candidate and, for tasks, the task."""

    rule: str
    candidate: str
    task: str | None = None

    @property
    def id(self) -> str:
        return self.candidate if self.task is None else f"{self.candidate}-{self.task}"


@dataclass(frozen=True)
class Verdict:
    case: Case
    outcome: RuleOutcome
    details: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    examples: tuple[str, ...] = ()
    limit: str | None = None  # where the limit is set: "thresholds.toml probabilities.limits.max_mean_kl = 0.01"
    recompute: str | None = None  # the fp8gate command that recomputes the measured number from the artifacts

    @property
    def passed(self) -> bool:
        return self.outcome.passed

    def explain(self) -> str:
        state = "passed" if self.passed else "FAILED"
        subject = f" on {self.case.task}" if self.case.task else ""
        lines = [f"{self.outcome.rule} {state} for candidate {self.case.candidate}{subject}"]
        width = max(len(label) for label, _ in self.outcome.rows)
        lines += [f"  {label:<{width}}  {_number(value)}" for label, value in self.outcome.rows]
        lines += [f"  note: {note}" for note in self.notes]
        if self.examples:
            lines.append(f"  first {len(self.examples)} flipped questions:")
            lines += self.examples
        if self.limit:
            lines.append(f"  limit: {self.limit}")
        if self.recompute:
            lines.append(f"  recompute: {self.recompute}")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {"candidate": self.case.candidate, "task": self.case.task, **self.outcome.as_dict(),
                "notes": list(self.notes), "details": self.details, "limit_key": self.limit,
                "recompute": self.recompute}


def fp8gate_command(*words: Any) -> str:
    """An ``fp8gate`` command line, shell-quoted, with paths as the user would type them."""
    return " ".join(shlex.quote(str(display_path(w)) if isinstance(w, Path) else str(w)) for w in ("fp8gate", *words))


def compare_logprobs_command(base: PassResult, cand: PassResult) -> str | None:
    """``fp8gate compare-logprobs`` on two passes' dumps (None: a pass wrote none)."""
    if base.logprobs_path is None or cand.logprobs_path is None:
        return None
    return fp8gate_command("compare-logprobs", base.logprobs_path, cand.logprobs_path)


def flips_command(base: PassResult, cand: PassResult, task: TaskSpec) -> str | None:
    """``fp8gate flips`` on two passes' samples of ``task`` (None: a pass did not run it)."""
    base_samples, cand_samples = base.samples.get(task.name), cand.samples.get(task.name)
    if base_samples is None or cand_samples is None:
        return None
    return fp8gate_command("flips", base_samples, cand_samples, "--filter", task.filter, "--metric", task.metric)


class Gate:
    """Evaluates rule cases against lazily measured models."""

    def __init__(self, config: GateConfig, measurements: Measurements) -> None:
        self.config = config
        self.measurements = measurements

    def evaluate(self, case: Case) -> Verdict:
        rule = rules.BY_NAME.get(case.rule)
        if rule is None:
            raise GateError(f"unknown rule {case.rule!r}; expected one of {', '.join(rules.BY_NAME)}")
        # Probability rules share one judge driven by their row; any other rule has a method of its name,
        # except the rules on generated text (issue 22), whose judges live in generation_verdicts.
        if rule.name in generation_verdicts.JUDGES:
            judged = generation_verdicts.JUDGES[rule.name](self, case)
            recompute = fp8gate_command("compare-logprobs", *judged.compare) if judged.compare else None
            return Verdict(case, judged.outcome, judged.details, judged.notes, limit=judged.limit, recompute=recompute)
        return self.probability(case) if rule.kind == "probability" else getattr(self, rule.name)(case)

    def _limit(self, key: str, value: Any) -> str:
        return f"{display_path(self.config.path)} {key} = {value:g}"

    # ---- check one: probabilities on the same text ---------------------------

    def logprob_comparison(self, candidate: str) -> LogprobComparison:
        base_result, cand_result = self.measurements.baseline(), self.measurements.candidate(candidate)
        if base_result.vocab_size != cand_result.vocab_size:
            raise GateError(f"candidate {candidate}: vocabulary of {cand_result.vocab_size} tokens differs from "
                            f"baseline {self.config.baseline.name}'s {base_result.vocab_size}; "
                            "the probability rules compare the two token by token")
        base, cand = base_result.main.logprobs, cand_result.main.logprobs
        assert base is not None and cand is not None
        try:
            return compare_logprobs(base, cand)
        except ComparisonError as err:
            raise GateError(f"candidate {candidate} vs baseline {self.config.baseline.name}: {err}") from None

    def logprob_floor(self) -> dict[str, LogprobComparison]:
        base = self.measurements.baseline().main.logprobs
        assert base is not None
        return {label: compare_logprobs(base, run.logprobs)
                for label, run in self.measurements.noise().items() if run.logprobs is not None}

    def probability(self, case: Case) -> Verdict:
        assert self.config.probabilities is not None
        limits = self.config.probabilities.limits
        rule = rules.BY_NAME[case.rule]
        assert rule.bound is not None and rule.ideal is not None and rule.se_field is not None
        comparison = self.logprob_comparison(case.candidate)
        floors = self.logprob_floor()
        measured = getattr(comparison, rule.name)
        if measured is None:
            raise GateError(
                f"{self.config.path}: probabilities.limits.{rule.limit_key}: the engine gave no distributions to "
                f"compute {rule.name} from (KL: {comparison.kl_kind}); remove the limit or use full_vocab/top_k"
            )
        ideal = rule.ideal
        floor_values = {label: getattr(c, rule.name) for label, c in floors.items()}
        worst = max(floor_values.values(), key=lambda v: abs(v - ideal)) if floor_values else None
        reference, factor = getattr(limits, rule.limit_key), limits.floor_ratio_for(rule.name)
        outcome = rule.bound(rule.name, measured, reference, worst, factor, ideal=ideal,
                             measured_se=getattr(comparison, rule.se_field) or 0.0, k_se=limits.limit_se)
        notes = [f"noise pass {label}: {rule.name} = {_number(v)} ({PASS_DESCRIPTIONS[label]})"
                 for label, v in floor_values.items()]
        if case.rule == "mean_kl":
            notes.append(f"KL(base || candidate) is {comparison.kl_kind}{self._kl_partition_note(comparison)}")
        if limits.limit_se > 0:
            notes.append(f"judged like accuracy: fails only when the limit is missed by more than "
                         f"{limits.limit_se:g} SE of the candidate's figure (limit_se; 0 judges the point estimate)")
        notes += generation_verdicts.candidate_noise_notes(self, case.candidate)
        notes.append(f"{comparison.positions} positions; same top {comparison.same_top:.5f} "
                     f"± {comparison.same_top_se:.5f}, RMS Δp {comparison.rms_dp:.5f}, "
                     f"PPL ratio {comparison.ppl_ratio:.6f}")
        details = {"comparison": comparison.as_dict(),
                   "noise_floor": {label: c.as_dict() for label, c in floors.items()}}
        recompute = compare_logprobs_command(self.measurements.baseline().main,
                                             self.measurements.candidate(case.candidate).main)
        if factor is not None and outcome.limit != reference:  # the floor-relative limit is the binding one
            key = f"floor_ratio.{rule.name}" if isinstance(limits.floor_ratio, Mapping) else "floor_ratio"
            limit = self._limit(f"probabilities.limits.{key}", factor)
        else:
            limit = self._limit(f"probabilities.limits.{rule.limit_key}", reference)
        return Verdict(case, outcome, details, tuple(notes), limit=limit, recompute=recompute)

    def _kl_partition_note(self, comparison: LogprobComparison) -> str:
        if comparison.kl_kind != TOPK_KL:
            return ""
        refusal = self.measurements.id_scoring_refusal
        if refusal is None:
            return " (the candidate scored on the baseline's top-k ids)"
        return f" (on the baseline ids in the candidate's own top-k; scoring given ids was refused: {refusal})"

    # ---- check two: answers on checkable tasks ------------------------------

    def _task(self, name: str | None) -> TaskSpec:
        return next(t for t in self.config.tasks if t.name == name)

    def _answers(self, run: PassResult, task: TaskSpec) -> list[AnswerRecord]:
        try:
            return run.answers(task)
        except DumpFormatError as err:  # the samples exist; the configured filter or metric does not fit them
            index = self.config.tasks.index(task)
            raise GateError(f"{self.config.path}: tasks[{index}] (filter {task.filter!r}, metric {task.metric!r}): "
                            f"lm-eval's samples do not have it: {err.expected} (in {err.path})") from None

    def answer_comparison(self, case: Case) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
        task = self._task(case.task)
        base = self._answers(self.measurements.baseline().main, task)
        accuracy = sum(answer.correct for answer in base) / len(base)
        floor = task.limits.min_baseline_accuracy
        if accuracy <= floor:
            raise GateError(
                f"baseline {self.config.baseline.name} scores {accuracy:.4f} on {task.name} ({len(base)} questions, "
                f"filter {task.filter!r}, metric {task.metric!r}), at or below {floor:g} "
                f"(tasks.limits.min_baseline_accuracy): the task cannot tell a broken build from a good one; "
                "check the task, filter, metric and few-shot setup"
            )
        cand = self._answers(self.measurements.candidate(case.candidate).main, task)
        floors = {label: compare_answers(base, self._answers(run, task))
                  for label, run in self.measurements.noise().items() if task.name in run.samples}
        return compare_answers(base, cand), floors

    def accuracy(self, case: Case) -> Verdict:
        task = self._task(case.task)
        comparison, floors = self.answer_comparison(case)
        outcome = rules.accuracy_within_se(comparison.accuracy_base, comparison.accuracy_cand, comparison.questions,
                                           k=task.limits.accuracy_se, two_sided=task.limits.two_sided)
        notes = [f"SE = sqrt(p(1-p)/n) with p the baseline accuracy; k = {task.limits.accuracy_se:g}"
                 f"{', two-sided' if task.limits.two_sided else ', one-sided (a drop fails)'}",
                 f"McNemar exact p on the flips: {comparison.mcnemar_p:.4g} (an addition to the article)"]
        notes += [f"noise pass {label}: accuracy {c.accuracy_cand:.4f}" for label, c in floors.items()]
        key = rules.BY_NAME[rules.ACCURACY].limit_key
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes),
                       limit=self._task_limit(task, key, getattr(task.limits, key)),
                       recompute=self._flips_command(case, task))

    def flips(self, case: Case) -> Verdict:
        task = self._task(case.task)
        comparison, floors = self.answer_comparison(case)
        floor_flips = max((c.flips for c in floors.values()), default=0)
        limits = task.limits
        outcome = rules.flips_within_noise_floor(comparison.flips, floor_flips, comparison.questions,
                                                 ratio=limits.flips_ratio,
                                                 min_allowance_fraction=limits.min_flip_allowance,
                                                 rule=limits.flip_rule, alpha=limits.flip_alpha)
        notes = [f"candidate flips: {comparison.right_to_wrong} right->wrong, {comparison.wrong_to_right} "
                 f"wrong->right; accuracy {comparison.accuracy_base:.4f} -> {comparison.accuracy_cand:.4f}; "
                 f"McNemar exact p {comparison.mcnemar_p:.4g}", _flip_rule_note(limits, floor_flips,
                                                                                comparison.questions, outcome)]
        notes += [f"noise pass {label}: {c.flips} flip{'' if c.flips == 1 else 's'} ({PASS_DESCRIPTIONS[label]})"
                  for label, c in floors.items()]
        if floor_flips == 0:
            notes.append("the noise floor is exactly 0 flips (a deterministic engine): the minimum allowance "
                         f"of {task.limits.min_flip_allowance:g} x questions applies")
        examples = tuple(
            f"    doc {f.doc_id} ({f.direction.replace('_', ' ')}), target {_short(f.target)}\n"
            f"      baseline : {_short(f.base_response)}\n      candidate: {_short(f.cand_response)}"
            for f in comparison.flipped[:FLIP_EXAMPLES]
        )
        key = "flip_alpha" if limits.flip_rule == rules.FLIP_BINOMIAL else rules.BY_NAME[rules.FLIPS].limit_key
        return Verdict(case, outcome, self._answer_details(comparison, floors), tuple(notes), examples,
                       limit=self._task_limit(task, key, getattr(limits, key)),
                       recompute=self._flips_command(case, task))

    def _task_limit(self, task: TaskSpec, key: str, value: float) -> str:
        return self._limit(f"tasks[{self.config.tasks.index(task)}].limits.{key}", value)

    def _flips_command(self, case: Case, task: TaskSpec) -> str | None:
        return flips_command(self.measurements.baseline().main, self.measurements.candidate(case.candidate).main,
                             task)

    @staticmethod
    def _answer_details(comparison: AnswerComparison, floors: dict[str, AnswerComparison]) -> dict[str, Any]:
        summary = {k: v for k, v in comparison.as_dict().items() if k != "flipped"}
        summary["flipped_doc_ids"] = [str(f.doc_id) for f in comparison.flipped]
        return {"comparison": summary,
                "noise_floor": {label: {k: v for k, v in c.as_dict().items() if k != "flipped"}
                                for label, c in floors.items()}}

    # ---- speed last ----------------------------------------------------------

    def speed(self, case: Case) -> Verdict:
        speed = self.config.speed
        assert speed is not None
        found = memory_bandwidth(speed)
        if found is None:
            raise GateError(f"{self.config.path}: speed: no memory-bandwidth figure for this device; "
                            "set speed.gpu to a known GPU or speed.bandwidth_gbps")
        gpu_name, bandwidth = found
        result = self.measurements.candidate(case.candidate)
        base = self.measurements.baseline()
        assert result.latency is not None and base.latency is not None
        context = roofline.decode_context_tokens(speed.input_len, speed.output_len)
        estimates = {name: _roofline(model, bandwidth, context) for name, model in (("candidate", result),
                                                                                     ("baseline", base))}
        cand = rules.DecodeSpeed(result.latency.decode_tok_s, _ceiling(estimates["candidate"]))
        base_speed = rules.DecodeSpeed(base.latency.decode_tok_s, _ceiling(estimates["baseline"]))
        outcome = rules.decode_speed(cand, base_speed, rule=speed.rule,
                                     min_share_of_baseline=speed.min_share_of_baseline,
                                     min_fraction_of_ceiling=speed.min_fraction_of_ceiling,
                                     overhead_bound_below=speed.overhead_bound_below,
                                     min_ratio_overhead_bound=speed.min_ratio_overhead_bound)
        notes = [f"{gpu_name}: {bandwidth:g} GB/s per GPU; bytes read per decoded token: "
                 + "; ".join(f"{name} {e.bytes_per_token / 1e9:.3f} GB over {_gpus(e, bandwidth):g} GPU(s)"
                             for name, e in estimates.items())
                 + f" (weights, and the KV cache at the decode's mean context of {context} tokens: "
                 f"{speed.input_len} in, {speed.output_len} out)",
                 _speed_judgement(speed, cand, base_speed),
                 f"decode excludes prefill: median {result.latency.median_prefill_s * 1e3:.1f} ms prefill of "
                 f"{speed.input_len} tokens, batch {speed.batch_size}",
                 f"KV-cache capacity: candidate {result.kv_cache_tokens} tokens, "
                 f"baseline {base.kv_cache_tokens} tokens"]
        details = {"latency": result.latency.as_dict(), "roofline": estimates["candidate"].as_dict(),
                   "baseline_roofline": estimates["baseline"].as_dict(),
                   "kv_cache_tokens": result.kv_cache_tokens, "baseline_kv_cache_tokens": base.kv_cache_tokens,
                   "baseline_latency": base.latency.as_dict()}
        key = _speed_limit_key(speed, cand, base_speed)
        return Verdict(case, outcome, details, tuple(notes), limit=self._limit(f"speed.{key}", getattr(speed, key)),
                       recompute=_roofline_command(*_roofline_inputs(result, bandwidth, context)))


def _flip_rule_note(limits: TaskLimits, floor_flips: int, questions: int, outcome: RuleOutcome) -> str:
    rows = dict(outcome.rows)
    resolution = rows[rules.RESOLUTION_ROW]
    if limits.flip_rule == rules.FLIP_BINOMIAL:
        judged = (f"judged by the one-sided exact conditional binomial test (an addition): fails when "
                  f"p < {limits.flip_alpha:g} and the count is above the minimum allowance, so at most "
                  f"{outcome.limit:g} flips pass against a floor of {floor_flips}")
    else:
        judged = (f"judged by the article's rule: at most max({limits.flips_ratio:g} x {floor_flips}, "
                  f"{rows['minimum allowance']:g}) = {outcome.limit:g} flips; p and SE margin are additions")
    floor_rate = floor_flips / questions
    times = f", {resolution / floor_rate:.3g} x the floor" if floor_rate > 0 else ""
    return (f"{judged}. Resolution at {questions} questions and a floor rate of {floor_rate:.3g}: a true flip "
            f"rate of {resolution:.3g}{times} is caught with {rules.DETECTION_POWER:.0%} power; a pass does not "
            f"rule out a candidate that flips less")


def _roofline_inputs(model: ModelResult, bandwidth_gbps: float, context_tokens: int) -> tuple[Path, dict[str, Any]]:
    """The weights and estimate_from_path arguments of the model's decode roofline.

    With tensor parallelism each GPU reads its shard of every token's bytes.
    """
    parallel = int(model.spec.engine.get("tensor_parallel_size", 1))
    return weights_dir(model.spec.model), {"quantization": model.spec.quantization,
                                           "bandwidth_gbps": bandwidth_gbps * parallel,
                                           "context_tokens": context_tokens,
                                           "kv_cache_dtype": model.spec.engine.get("kv_cache_dtype")}


def _roofline(model: ModelResult, bandwidth_gbps: float, context_tokens: int) -> roofline.RooflineEstimate:
    weights, arguments = _roofline_inputs(model, bandwidth_gbps, context_tokens)
    try:
        return roofline.estimate_from_path(weights, **arguments)
    except RooflineError as err:
        raise GateError(f"speed: cannot compute the roofline of {model.spec.name}: {err}") from None


# estimate_from_path's arguments as `fp8gate roofline` options
_ROOFLINE_OPTIONS = {"quantization": "--quantization", "bandwidth_gbps": "--bandwidth-gbps",
                     "context_tokens": "--context", "kv_cache_dtype": "--kv-cache-dtype"}


def _roofline_command(weights: Path, arguments: dict[str, Any]) -> str:
    options = [word for key, value in arguments.items() if value is not None
               for word in (_ROOFLINE_OPTIONS[key], f"{value:g}" if isinstance(value, float) else value)]
    return fp8gate_command("roofline", weights, *options)


def _gpus(estimate: roofline.RooflineEstimate, bandwidth_gbps: float) -> float:
    """How many GPUs' bandwidth the estimate spans (tensor parallelism)."""
    assert estimate.bandwidth_gbps is not None  # a bandwidth was always given
    return estimate.bandwidth_gbps / bandwidth_gbps


def _ceiling(estimate: roofline.RooflineEstimate) -> float:
    assert estimate.ceiling_tok_s is not None  # a bandwidth was always given
    return estimate.ceiling_tok_s


def _speed_limit_key(speed: SpeedSpec, cand: rules.DecodeSpeed, base: rules.DecodeSpeed) -> str:
    """The [speed] key of the limit that decode_speed applied."""
    if any(rules.is_overhead_bound(s, speed.overhead_bound_below) for s in (cand, base)):
        return "min_ratio_overhead_bound"
    return "min_fraction_of_ceiling" if speed.rule == rules.SHARE_OF_CEILING else "min_share_of_baseline"


def _speed_judgement(speed: SpeedSpec, cand: rules.DecodeSpeed, base: rules.DecodeSpeed) -> str:
    bound = [(name, s) for name, s in (("candidate", cand), ("baseline", base))
             if rules.is_overhead_bound(s, speed.overhead_bound_below)]
    if bound:
        name, s = bound[0]
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


def _number(value: float) -> str:
    return f"{value:.6g}"


def _short(text: str, limit: int = 160) -> str:
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")
