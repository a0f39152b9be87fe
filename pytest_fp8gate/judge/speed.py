"""The speed rules' verdicts: batch-1 decode against its bandwidth ceiling, throughput and latency
under load (served models), and a speculator's mean acceptance length (served models)."""

from __future__ import annotations

from collections.abc import Mapping

from ..config.spec import LoadSpec, SpeedSpec
from ..core import roofline, rules, spec_decode
from ..core.rules import RuleOutcome
from ..errors import GateError
from ..run.record import ModelResult
from .judging import Judging
from .recompute import roofline_command
from .rooflines import ceiling, experts_read, gpus, load_roofline, model_roofline, roofline_inputs
from .verdict import Case, Verdict, number


def speed(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    config = judging.config
    spec = config.speed
    assert spec is not None
    result = judging.records.candidate(case.candidate)
    base = judging.comparisons.baseline()
    # Configured in [speed], else what measuring found for this session's GPU.
    found = (spec.gpu, spec.bandwidth_gbps) if spec.bandwidth_gbps > 0 else result.memory_bandwidth
    if found is None:
        raise GateError(f"{config.path}: speed: no memory-bandwidth figure for this device; "
                        "set speed.gpu to a known GPU or speed.bandwidth_gbps")
    gpu_name, bandwidth = found
    assert result.latency is not None and base.latency is not None
    context = roofline.decode_context_tokens(spec.input_len, spec.output_len)
    estimates = {name: model_roofline(model, bandwidth, context, spec.batch_size)
                 for name, model in (("candidate", result), ("baseline", base))}
    cand = rules.DecodeSpeed(result.latency.decode_tok_s, ceiling(estimates["candidate"]))
    base_speed = rules.DecodeSpeed(base.latency.decode_tok_s, ceiling(estimates["baseline"]))
    _refuse_above_ceiling({result.spec.name: cand, base.spec.name: base_speed}, bandwidth)
    outcome = rules.decode_speed(cand, base_speed, rule=spec.rule, min_share_of_baseline=spec.min_share_of_baseline,
                                 min_fraction_of_ceiling=spec.min_fraction_of_ceiling,
                                 overhead_bound_below=spec.overhead_bound_below,
                                 min_ratio_overhead_bound=spec.min_ratio_overhead_bound)
    notes = [f"{gpu_name}: {bandwidth:g} GB/s per GPU; bytes read per decoded token: "
             + "; ".join(f"{name} {e.bytes_per_step / e.batch / 1e9:.3f} GB over {gpus(e, bandwidth):g} GPU(s)"
                         + experts_read(e) for name, e in estimates.items())
             + f" (weights, and the KV cache at the decode's mean context of {context} tokens: "
             f"{spec.input_len} in, {spec.output_len} out)",
             _speed_judgement(spec, outcome, {"candidate": cand, "baseline": base_speed}),
             f"decode excludes prefill: median {result.latency.median_prefill_s * 1e3:.1f} ms prefill of "
             f"{spec.input_len} tokens, batch {spec.batch_size}",
             f"KV-cache capacity: candidate {result.kv_cache_tokens} tokens, "
             f"baseline {base.kv_cache_tokens} tokens"]
    if result.bandwidth_warning:  # measuring found NVML disagreeing with the table's figure
        notes.append(result.bandwidth_warning)
    details = {"latency": result.latency.as_dict(), "roofline": estimates["candidate"].as_dict(),
               "baseline_roofline": estimates["baseline"].as_dict(),
               "kv_cache_tokens": result.kv_cache_tokens, "baseline_kv_cache_tokens": base.kv_cache_tokens,
               "baseline_latency": base.latency.as_dict()}
    key = outcome.limit_key
    return Verdict(case, outcome, details, tuple(notes), limit=judging.limit(f"speed.{key}", getattr(spec, key)),
                   recompute=roofline_command(*roofline_inputs(result, bandwidth, context, spec.batch_size)))


def load(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """Speed under load at a served endpoint: throughput against the baseline's, and the latency SLOs."""
    spec = judging.config.load
    assert spec is not None
    result, base = judging.records.candidate(case.candidate), judging.comparisons.baseline()
    if result.load is None or base.load is None:  # measuring runs every level of a model needing the rule
        raise GateError(f"{judging.config.path}: load: no load levels measured for "
                        f"{base.spec.name if base.load is None else result.spec.name}")
    try:
        outcome = rules.throughput_under_load(result.load, base.load, spec.min_throughput_fraction, spec.slos())
    except ValueError as err:
        raise GateError(f"load: cannot judge {case.candidate} against {base.spec.name}: {err}") from None
    notes = [_load_judgement(spec, outcome), *_load_table(result.load, base.load),
             f"each level: streamed requests of {spec.input_len} random prompt ids, {spec.output_len} tokens "
             "out (ignore_eos), the same prompts for both models; output tok/s = all output tokens over the "
             "level's wall time; TPOT per request = (last - first token) / (tokens - 1)",
             f"KV-cache capacity (from the server): candidate {result.kv_cache_tokens} tokens, "
             f"baseline {base.kv_cache_tokens} tokens"]
    notes += load_roofline(spec, {"candidate": result, "baseline": base})
    details = {"levels": [level.as_dict() for level in result.load],
               "baseline_levels": [level.as_dict() for level in base.load],
               "kv_cache_tokens": result.kv_cache_tokens, "baseline_kv_cache_tokens": base.kv_cache_tokens}
    key = outcome.limit_key
    return Verdict(case, outcome, details, tuple(notes), limit=judging.limit(f"load.{key}", getattr(spec, key)))


def acceptance(judging: Judging, case: Case, rule: rules.Rule) -> Verdict:
    """A speculator's mean acceptance length on the candidate against the baseline's (served models)."""
    spec = judging.config.speculative
    assert spec is not None
    result, base = judging.records.candidate(case.candidate), judging.comparisons.baseline()
    try:
        candidate, baseline = (spec_decode.total(model.spec_decode, model.spec.name, spec.min_drafts)
                               for model in (result, base))
        outcome = rules.acceptance_at_least(candidate, baseline, spec.min_acceptance_ratio)
    except ValueError as err:
        raise GateError(f"acceptance: cannot judge {case.candidate} against {base.spec.name}: {err}") from None
    notes = ["mean acceptance length = 1 + accepted tokens / drafts (vLLM's gsm8k CI), from vllm:spec_decode_* "
             "counters read at /metrics before and after the " + " and ".join(
                 w.label for w in base.spec_decode or []) + " pass of each model (the same requests for both)",
             *(f"{model.spec.name}: --speculative-config {_speculative_config(model)}" for model in (base, result))]
    details = {"windows": [w.as_dict() for w in result.spec_decode or []],
               "baseline_windows": [w.as_dict() for w in base.spec_decode or []]}
    return Verdict(case, outcome, details, tuple(notes),
                   limit=judging.limit("speculative.min_acceptance_ratio", spec.min_acceptance_ratio))


def _speculative_config(model: ModelResult) -> str:
    served = model.spec.served
    found = spec_decode.speculative_config(served.command) if served is not None else None
    return found if found is not None else "(not on a command line the gate started: an external endpoint)"


def _load_judgement(load: LoadSpec, outcome: RuleOutcome) -> str:
    """Which checks ran at every level, and which one bound (or failed) at which level."""
    checks = [f"candidate output tok/s >= {load.min_throughput_fraction:g} x the baseline's "
              "(load.min_throughput_fraction)"]
    checks += [f"candidate {key.removeprefix('max_').removesuffix('_s').replace('_', ' ').upper()} <= {limit:g} s "
               f"(load.{key})" for key, limit in load.slos().items() if limit is not None]
    state = "failed" if not outcome.passed else "bound"
    return (f"judged at concurrencies {', '.join(map(str, load.concurrencies))}: " + "; ".join(checks)
            + f". {state} at {outcome.bound_by} by load.{outcome.limit_key}: {number(outcome.measured)} against "
            f"{number(outcome.limit)}")


def _load_table(candidate: list[rules.LoadLevel], baseline: list[rules.LoadLevel]) -> list[str]:
    """Each level's figures of both models side by side, one line a level."""
    return [f"c={own.concurrency}, {own.requests} requests: output tok/s baseline {b['tok_s']}, candidate "
            f"{c['tok_s']} ({fraction}); TTFT p50/p99 baseline {b['ttft_p50']}/{b['ttft_p99']} s, candidate "
            f"{c['ttft_p50']}/{c['ttft_p99']} s; TPOT p50/p99 baseline {b['tpot_p50']}/{b['tpot_p99']} ms, "
            f"candidate {c['tpot_p50']}/{c['tpot_p99']} ms"
            for own, c, b, fraction in rules.shown_level_pairs(candidate, baseline)]


def _refuse_above_ceiling(speeds: Mapping[str, rules.DecodeSpeed], bandwidth: float) -> None:
    """A decode faster than its bandwidth ceiling means the bytes per token or the bandwidth are wrong,
    so no speed verdict can be read from them."""
    for name, found in speeds.items():
        if found.share > 1:
            raise GateError(
                f"speed: {name} decodes {found.tok_s:.1f} tok/s, {found.share:.2f} x its roofline ceiling of "
                f"{found.ceiling_tok_s:.1f} tok/s at {bandwidth:g} GB/s, which no GPU can do: the byte model "
                "counts more bytes per token than the model reads (a MoE whose router touches fewer experts than "
                "the uniform model's, say) or the bandwidth figure is too low (speed.gpu, "
                "speed.bandwidth_gbps); refusing a speed verdict from either")


def _speed_judgement(spec: SpeedSpec, outcome: RuleOutcome, models: dict[str, rules.DecodeSpeed]) -> str:
    if outcome.bound_by is not None:
        name, s = outcome.bound_by, models[outcome.bound_by]
        return (f"the {name} is overhead-bound: its bytes take {1e6 / s.ceiling_tok_s:.1f} us at full bandwidth "
                f"of a measured {1e6 / s.tok_s:.1f} us per token ({s.share:.2%} of the ceiling, under "
                f"speed.overhead_bound_below = {spec.overhead_bound_below:g}), so no bandwidth ceiling applies; "
                f"judged by candidate tok/s against the baseline's (speed.min_ratio_overhead_bound)")
    if spec.rule == rules.SHARE_OF_CEILING:
        return (f"judged as the article does: the candidate's share of its ceiling against "
                f"speed.min_fraction_of_ceiling (speed.rule = {spec.rule!r})")
    return (f"judged against the baseline on the same GPU: the candidate's share of its ceiling over the "
            f"baseline's share, which equals the measured speedup over the speedup the bytes allow "
            f"(speed.rule = {spec.rule!r}, limit speed.min_share_of_baseline)")
