"""The models' decode rooflines the speed verdicts read: bytes per decode step at the measured
bandwidth, a mixture of experts' experts read, and the GPUs a tensor-parallel model spans."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config.spec import LoadSpec
from ..core import roofline
from ..errors import GateError, RooflineError
from ..run.record import ModelResult


def roofline_inputs(model: ModelResult, bandwidth_gbps: float, context_tokens: int,
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


def model_roofline(model: ModelResult, bandwidth_gbps: float, context_tokens: int,
                   batch: int = 1) -> roofline.RooflineEstimate:
    weights, arguments = roofline_inputs(model, bandwidth_gbps, context_tokens, batch)
    try:
        return roofline.estimate_from_path(weights, **arguments)
    except RooflineError as err:
        raise GateError(f"speed: cannot compute the roofline of {model.spec.name}: {err}") from None


def load_roofline(load: LoadSpec, models: dict[str, ModelResult]) -> list[str]:
    """A mixture of experts' bytes per decode step at each level: nEff experts at concurrency B."""
    context = roofline.decode_context_tokens(load.input_len, load.output_len)
    lines = []
    for name, model in models.items():
        try:
            steps = [model_roofline(model, 0.0, context, level) for level in load.concurrencies]
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


def experts_read(estimate: roofline.RooflineEstimate) -> str:
    """How many routed experts the step's bytes count, for a mixture of experts."""
    if not estimate.experts:
        return ""
    return (f" ({estimate.active_experts:.3g} of {estimate.experts} experts a MoE layer at batch {estimate.batch}: "
            f"nEff = N (1 - ((N - k) / N)^B), k = {estimate.experts_per_token}, uniform routing)")


def gpus(estimate: roofline.RooflineEstimate, bandwidth_gbps: float) -> float:
    """How many GPUs' bandwidth the estimate spans (tensor parallelism)."""
    assert estimate.bandwidth_gbps is not None  # a bandwidth was always given
    return estimate.bandwidth_gbps / bandwidth_gbps


def ceiling(estimate: roofline.RooflineEstimate) -> float:
    assert estimate.ceiling_tok_s is not None  # a bandwidth was always given
    return estimate.ceiling_tok_s
