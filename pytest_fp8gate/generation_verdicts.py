"""Verdicts of the rules on generated text: the decode phase, decode against prefill, and the
answers' length and validity. Each puts the candidate beside the same figure for the noise floor,
and the decode-phase figures beside the candidate's prefill figures on the corpus."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import decode_passes, rules
from .answers import invalid_rate, length_drift
from .decode_phase import DecodeComparison, compare_decode
from .dumps import read_lm_eval_generations
from .errors import ComparisonError, GateError
from .logprobs import compare_logprobs
from .rules import RuleOutcome

if TYPE_CHECKING:
    from .gate import Case, Gate, Verdict


@dataclass(frozen=True)
class Judged:
    """A verdict's parts, which ``Gate`` puts together with its case."""

    outcome: RuleOutcome
    details: dict[str, Any]
    notes: tuple[str, ...]
    limit: str
    compare: tuple[Path, Path] | None = None  # two logprob dumps whose fp8gate compare-logprobs recomputes it

# The floor of a decode-phase figure: an identical candidate would still show the baseline's own gap.
BASELINE_GAP = "baseline decode vs prefill"
SIDE_BY_SIDE = "side_by_side"  # the verdict's details key holding the decode/prefill line of the report


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


def _compare(gate: Gate, what: str, base: Any, cand: Any) -> DecodeComparison:
    try:
        return compare_decode(base, cand)
    except ComparisonError as err:
        raise GateError(f"{what}: {err}") from None


def decode_comparisons(gate: Gate, candidate: str) -> tuple[DecodeComparison, dict[str, DecodeComparison]]:
    """The candidate's prefill of the baseline's continuations against the baseline's decode-time
    log-probs, and the same comparison for each floor (the baseline's own prefill and noise passes)."""
    measurements = gate.measurements
    measurements.candidate(candidate)
    base = measurements.decode[gate.config.baseline.name]
    cand = measurements.decode[candidate]
    assert cand.on_baseline is not None
    floors = {BASELINE_GAP: _compare(gate, "baseline decode vs prefill", base.own, base.own_prefill)}
    floors.update({label: _compare(gate, f"noise pass {label}", base.own, run)
                   for label, run in measurements.decode_floor.items()})
    return _compare(gate, f"candidate {candidate} on the baseline's continuations", base.own,
                    cand.on_baseline), floors


def gap_comparisons(gate: Gate, candidate: str) -> tuple[DecodeComparison, DecodeComparison]:
    """Decode against prefill of the same ids: the candidate's on its own continuations, the baseline's on its own."""
    measurements = gate.measurements
    measurements.candidate(candidate)
    base = measurements.decode[gate.config.baseline.name]
    cand = measurements.decode[candidate]
    return (_compare(gate, f"candidate {candidate} decode vs prefill", cand.own, cand.own_prefill),
            _compare(gate, "baseline decode vs prefill", base.own, base.own_prefill))


def _prefill_line(gate: Gate, candidate: str) -> str | None:
    """The candidate's prefill figures on the corpus, when the probability check measured them."""
    base = gate.measurements.baseline().main.logprobs
    cand = gate.measurements.candidate(candidate).main.logprobs
    if base is None or cand is None:
        return None
    c = compare_logprobs(base, cand)
    kl = "-" if c.mean_kl is None else f"{c.mean_kl:.6g}"
    return f"same top {c.same_top:.5f}, RMS Δp {c.rms_dp:.5f}, KL {kl} ({c.kl_kind})"


def decode_phase(gate: Gate, case: Case) -> Judged:
    """decode_same_top, decode_rms_dp, decode_mean_kl: the probability rules' judgement on generated positions."""
    decode = gate.config.decode
    assert decode is not None
    limits = decode.limits
    rule = rules.BY_NAME[case.rule]
    assert rule.bound is not None and rule.ideal is not None and rule.se_field is not None
    metric = rule.name.removeprefix(rules.DECODE_PREFIX)
    comparison, floors = decode_comparisons(gate, case.candidate)
    measured = getattr(comparison.logprobs, metric)
    if measured is None:
        raise GateError(f"{gate.config.path}: decode.limits.{rule.limit_key}: the engine gave no distributions to "
                        f"compute {metric} from (KL: {comparison.logprobs.kl_kind})")
    floor_values = {label: getattr(c.logprobs, metric) for label, c in floors.items()
                    if getattr(c.logprobs, metric) is not None}
    ideal = rule.ideal
    worst = max(floor_values.values(), key=lambda v: abs(v - ideal))
    reference = getattr(limits, rule.limit_key)
    outcome = rule.bound(rule.name, measured, reference, worst, limits.floor_ratio, ideal=rule.ideal,
                         measured_se=getattr(comparison.logprobs, rule.se_field) or 0.0, k_se=limits.limit_se)
    prefill = _prefill_line(gate, case.candidate)
    notes = [f"on {comparison.logprobs.positions} generated positions ({comparison.sequences} greedy continuations "
             f"of {decode.new_tokens} tokens the baseline wrote after {decode.prompt_tokens}-token corpus prompts; "
             "the candidate prefilled the exact ids)",
             f"decode phase: {_figures(comparison)}"]
    if prefill:
        notes.append(f"prefill on the corpus: {prefill}")
    notes += [f"floor {label}: {metric} = {v:.6g}" for label, v in floor_values.items()]
    notes += candidate_noise_notes(gate, case.candidate)
    side = f"decode {_figures(comparison)}" + (f" | prefill {prefill}" if prefill else "")
    details = {"comparison": comparison.as_dict(), "noise_floor": {k: c.as_dict() for k, c in floors.items()},
               SIDE_BY_SIDE: side}
    key = "floor_ratio" if limits.floor_ratio is not None and outcome.limit != reference else rule.limit_key
    value = limits.floor_ratio if key == "floor_ratio" else reference
    dumps = (gate.measurements.decode[gate.config.baseline.name].dumps.get(decode_passes.DECODE),
             gate.measurements.decode[case.candidate].dumps.get(decode_passes.ON_BASELINE))
    return Judged(outcome, details, tuple(notes), limit=gate._limit(f"decode.limits.{key}", value),
                  compare=_pair(*dumps))


def decode_gap(gate: Gate, case: Case) -> Judged:
    """The candidate's decode-time log-probs against its prefill of the same ids, within max_gap_kl or
    gap_ratio x the baseline's own gap (not zero on GPUs)."""
    decode = gate.config.decode
    assert decode is not None
    limits = decode.limits
    assert limits.max_gap_kl is not None  # the rule is collected only where it is set
    cand, base = gap_comparisons(gate, case.candidate)
    if cand.mean_kl is None or base.mean_kl is None:
        raise GateError(f"{gate.config.path}: decode.limits.max_gap_kl: the engine gave no distributions to "
                        f"compute KL from (KL: {cand.logprobs.kl_kind})")
    outcome = rules.at_most_or_floor(rules.DECODE_GAP, cand.mean_kl, limits.max_gap_kl, base.mean_kl,
                                     limits.gap_ratio, measured_se=cand.logprobs.kl_se or 0.0, k_se=limits.limit_se)
    notes = [f"candidate decode vs its own prefill: {_figures(cand)}",
             f"baseline decode vs its own prefill (noise floor): {_figures(base)}",
             "KL(decode || prefill) on each model's own greedy continuations; a KV-cache path that prefill-only "
             "scoring cannot see (an FP8 KV cache) shows here"]
    details = {"comparison": cand.as_dict(), "noise_floor": {BASELINE_GAP: base.as_dict()},
               SIDE_BY_SIDE: f"decode vs prefill: candidate KL {cand.mean_kl:.6g}, baseline KL {base.mean_kl:.6g}"}
    key = "gap_ratio" if outcome.limit != limits.max_gap_kl else "max_gap_kl"
    dumps = gate.measurements.decode[case.candidate].dumps
    return Judged(outcome, details, tuple(notes), limit=gate._limit(f"decode.limits.{key}", getattr(limits, key)),
                  compare=_pair(dumps.get(decode_passes.DECODE), dumps.get(decode_passes.PREFILL)))


def _pair(first: Path | None, second: Path | None) -> tuple[Path, Path] | None:
    return (first, second) if first is not None and second is not None else None


def length_drift_verdict(gate: Gate, case: Case) -> Judged:
    """Mean output length against the baseline's, next to the noise passes' own drift."""
    task = gate._task(case.task)
    measurements = gate.measurements
    max_drift = task.limits.max_length_drift
    assert max_drift is not None

    def generations(run: Any) -> dict[Any, str]:
        return read_lm_eval_generations(run.samples[task.name], task.filter)

    base = generations(measurements.baseline().main)
    drift = length_drift(base, generations(measurements.candidate(case.candidate).main))
    floors = {label: length_drift(base, generations(run))
              for label, run in measurements.noise().items() if task.name in run.samples}
    worst = max(floors.values(), key=abs) if floors else None
    outcome = rules.length_drift_within(drift, worst, max_drift, task.limits.flips_ratio)
    notes = [f"mean length of the raw generations in characters: candidate {drift:+.2%} against the baseline "
             f"(MLPerf TEST09 bounds it at ±10%)"]
    notes += [f"noise pass {label}: {d:+.2%}" for label, d in floors.items()]
    index = gate.config.tasks.index(task)
    return Judged(outcome, {"drift": drift, "noise_floor": floors}, tuple(notes),
                   limit=gate._limit(f"tasks[{index}].limits.max_length_drift", max_drift))


def invalid_rate_verdict(gate: Gate, case: Case) -> Judged:
    """The share of answers with nothing parsable under the task's filter, against the baseline's."""
    task = gate._task(case.task)
    measurements = gate.measurements
    max_increase = task.limits.max_invalid_increase
    assert max_increase is not None
    base = gate._answers(measurements.baseline().main, task)
    cand = gate._answers(measurements.candidate(case.candidate).main, task)
    floors = {label: invalid_rate(gate._answers(run, task))
              for label, run in measurements.noise().items() if task.name in run.samples}
    base_rate, cand_rate = invalid_rate(base), invalid_rate(cand)
    outcome = rules.invalid_rate_within(base_rate, cand_rate, max(floors.values()) if floors else None, len(cand),
                                        max_increase, task.limits.accuracy_se)
    notes = [f"invalid: no answer under filter {task.filter!r} (lm-eval's \"[invalid]\" or empty); baseline "
             f"{base_rate:.4f}, candidate {cand_rate:.4f}"]
    notes += [f"noise pass {label}: {r:.4f}" for label, r in floors.items()]
    index = gate.config.tasks.index(task)
    return Judged(outcome, {"baseline": base_rate, "candidate": cand_rate, "noise_floor": floors},
                   tuple(notes), limit=gate._limit(f"tasks[{index}].limits.max_invalid_increase", max_increase))


JUDGES = {"decode_same_top": decode_phase, "decode_rms_dp": decode_phase, "decode_mean_kl": decode_phase,
          rules.DECODE_GAP: decode_gap, rules.LENGTH_DRIFT: length_drift_verdict,
          rules.INVALID_RATE: invalid_rate_verdict}


def candidate_noise_notes(gate: Gate, candidate: str) -> list[str]:
    """The candidate against itself in another batch order ([noise] candidate_passes), beside the baseline's floor."""
    notes = []
    own = gate.measurements.candidate_noise.get(candidate, {})
    main = gate.measurements.candidate(candidate).main.logprobs
    floors = gate.measurements.noise()
    base = gate.measurements.baseline().main.logprobs
    for label, run in own.items():
        if main is None or run.logprobs is None:
            continue
        mine = compare_logprobs(main, run.logprobs)
        line = f"candidate noise pass {label}: same top {mine.same_top:.5f}, KL {mine.mean_kl}"
        if base is not None and label in floors and floors[label].logprobs is not None:
            theirs = compare_logprobs(base, floors[label].logprobs)  # type: ignore[arg-type]
            line += f" (the baseline's own: same top {theirs.same_top:.5f}, KL {theirs.mean_kl})"
        notes.append(line)
    return notes


def report_lines(verdicts: list[Verdict]) -> list[str]:
    """The decode-phase figures beside the prefill figures, once per candidate, for the markdown report."""
    seen = []
    for verdict in verdicts:
        line = verdict.details.get(SIDE_BY_SIDE)
        if line and line not in seen:
            seen.append(line)
    return [f"Decode phase: {line}" for line in seen] + ([""] if seen else [])
