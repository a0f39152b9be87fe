"""What the flip verdict says beside its figures: how the rule judged, what the noise floor was made of,
and the first flipped questions."""

from __future__ import annotations

from ..config.spec import TaskLimits
from ..core import rules
from ..core.answers import AnswerComparison
from ..core.rules import RuleOutcome

FLIP_EXAMPLES = 3


def flip_rule_note(limits: TaskLimits, outcome: RuleOutcome, questions: int, level: float | None) -> str:
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


def flip_floor_notes(limits: TaskLimits, floor_count: int, floor_flips: int, passes: int, agree_p: float,
                     questions: int) -> list[str]:
    """Whether ``floor_count`` noise passes were pooled, and what a floor of 0 or a saturated one means."""
    notes = []
    if floor_count > 1:
        notes.append(f"the noise passes' counts {'agree' if passes > 1 else 'differ'} (p = {agree_p:.3g} that "
                     "equal rates spread them this far; pooled unless below 0.05): "
                     + ("summed as repeated measurements of one floor" if passes > 1
                        else "the worst pass alone is the floor"))
    if floor_flips == 0:
        notes.append("the noise floor is exactly 0 flips (a deterministic engine): the minimum allowance "
                     f"of {limits.min_flip_allowance:g} x questions applies")
    elif (floor_rate := floor_flips / passes / questions) > rules.SATURATED_FLIP_FLOOR:
        notes.append(saturated_floor_note(floor_rate))
    return notes


def saturated_floor_note(floor_rate: float) -> str:
    """Why a flip verdict means little when the baseline alone re-rolls many answers, and what steadies it."""
    return (f"the noise floor is saturated: the baseline alone changes {floor_rate:.1%} of its answers between "
            f"passes (above {rules.SATURATED_FLIP_FLOOR:.0%}), so any perturbation re-rolls the same unstable "
            "questions and flips no longer separate the candidate from noise; the probability rules remain the "
            "signal. To steady the floor: batch-invariant kernels (VLLM_BATCH_INVARIANT=1 in the models' env, "
            "where the installed vLLM has them), deterministic_scheduling = true, or fewer requests in flight "
            "(max_in_flight on a served model)")


def flip_examples(comparison: AnswerComparison) -> tuple[str, ...]:
    """The first flipped questions: each one's target and both models' responses, shortened."""
    return tuple(
        f"    doc {f.doc_id} ({f.direction.replace('_', ' ')}), target {_short(f.target)}\n"
        f"      baseline : {_short(f.base_response)}\n      candidate: {_short(f.cand_response)}"
        for f in comparison.flipped[:FLIP_EXAMPLES]
    )


def _short(text: str, limit: int = 160) -> str:
    flat = " ".join(str(text).split())
    return repr(flat if len(flat) <= limit else flat[: limit - 3] + "...")
