"""What thresholds.toml may hold: each table's keys and the check each value passes.

The defaults are the field defaults of spec.py's dataclasses, which the loader (loader.py) fills
from these tables; the checks are in checks.py. Every key is documented in docs/thresholds.md.
"""

from __future__ import annotations

from typing import Any, Callable

from ..core.rules import BY_KIND, FLIP_RULES, SPEED_RULES, Kind
from .checks import (
    FRACTION,
    POSITIVE_FRACTION,
    RATIO,
    Check,
    boolean,
    bucket_edges,
    chunk_tokens,
    concurrencies,
    expected_protocol,
    floor_ratio,
    full_vocab,
    integer,
    number,
    reference_ratio,
    references,
    text,
    vllm_name,
)
from .spec import BACKENDS, REFERENCES
from .vllm_names import KV_CACHE_DTYPES, QUANTIZATION_METHODS

TOP_KEYS = ("device", "deterministic_scheduling", "run_alpha", "baseline", "candidates", "noise", "probabilities",
            "decode", "tasks", "speed", "load", "speculative")
NOISE_KEYS = ("passes", "candidate_passes")

# --- served models (issue 20) -------------------------------------------------
SERVED_ONLY_KEYS = ("serve", "health_timeout_s", "endpoint", "served_model_name", "api_key_env",
                    "request_deadline_s", "max_in_flight")
SERVE_INSTEAD = {
    "model": "the command names the model (vllm serve MODEL)",
    "quantization": "give --quantization in the command",
    "served_model_name": "give --served-model-name in the command",
    "api_key_env": "the gate's own server needs no key (api_key_env is for an endpoint)",
}
# Flags of a serve command that the gate's own checks read (context fit, GPU count, roofline bytes).
SERVE_ENGINE_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--max-model-len": ("max_model_len", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--pipeline-parallel-size": ("pipeline_parallel_size", int),
    "--data-parallel-size": ("data_parallel_size", int),
    "--dtype": ("dtype", str),
    "--tokenizer": ("tokenizer", str),
    "--revision": ("revision", str),
}

# Engine keys whose values the gate checks more strictly than their vLLM type (ranges, names), all
# EngineArgs fields in every supported vLLM release: a table of only these needs no vLLM import
# (seconds, torch included). Every other key is checked against the installed vLLM's EngineArgs.
ENGINE_RANGES: dict[str, Check] = {
    "tensor_parallel_size": integer(1),
    "pipeline_parallel_size": integer(1),
    "data_parallel_size": integer(1),
    "max_model_len": integer(1),
    "gpu_memory_utilization": number(0, 1, low_open=True),
    "kv_cache_dtype": vllm_name("kv_cache_dtype", KV_CACHE_DTYPES),
    "max_num_seqs": integer(1),
    "max_num_batched_tokens": integer(1),
    "seed": integer(0),
    "revision": text(),
    "tokenizer": text(),
    "block_size": integer(1),
    "kv_cache_memory_bytes": integer(1),
    "enforce_eager": boolean,
    "trust_remote_code": boolean,
    "enable_prefix_caching": boolean,
    "dtype": text(("auto", "half", "float16", "bfloat16", "float", "float32")),
    "distributed_executor_backend": text(("mp", "ray", "uni", "external_launcher")),
}
# Set by the gate itself for the whole process (deterministic_scheduling), not per engine.
GATE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "set by the gate from deterministic_scheduling"}
QUANTIZATION = vllm_name("quantization method", QUANTIZATION_METHODS, allow_empty=True)
MODEL_KEYS = ("name", "model", "quantization", "backend", "engine", "env", "lora", *SERVED_ONLY_KEYS)
BACKEND = text(BACKENDS)
LORA_KEYS = ("name", "path")
DATASET_CHECKS = {"dataset": text(), "name": text(), "split": text(), "column": text()}
PROBABILITY_CHECKS = {
    "chunks": integer(1),
    "chunk_tokens": chunk_tokens,
    "top_k": integer(1),
    "full_vocab": full_vocab,
    "bucket_edges": bucket_edges,
    "min_bucket_positions": integer(1),
    "references": references,
}
PROBABILITY_KEYS = (*PROBABILITY_CHECKS, "corpus", "limits")
# The limits the probability rules and their decode-phase twins share.
FIDELITY_LIMIT_CHECKS = {"min_same_top": POSITIVE_FRACTION, "max_rms_dp": FRACTION, "max_mean_kl": number(0)}
# A probability row's limit with no check of its own here is a non-negative number (a KL, a share of Δp).
PROBABILITY_LIMIT_CHECKS = {
    **{rule.limit_key: number(0) for rule in BY_KIND[Kind.PROBABILITY]},
    **FIDELITY_LIMIT_CHECKS,
    "max_ppl_ratio": RATIO,
    "floor_ratio": floor_ratio,
    "limit_se": number(0),
    "per_bucket": boolean,
    "reference": text(REFERENCES),
    "reference_ratio": reference_ratio,
}
PROBABILITY_METRIC_LIMITS = tuple(rule.limit_key for rule in BY_KIND[Kind.PROBABILITY])
TASK_CHECKS = {
    "task": text(),
    "metric": text(),
    "num_fewshot": integer(0),
    "limit": integer(0),
    "filter": text(),
    "add_bos_token": boolean,
    "apply_chat_template": boolean,
    "fewshot_as_multiturn": boolean,
    "include_path": text(allow_empty=True),
    "max_gen_toks": integer(1),
    "think_end": text(),
}
TASK_KEYS = (*TASK_CHECKS, "name", "limits", "chat_template_kwargs")
TASK_LIMIT_CHECKS = {
    "accuracy_se": number(0, low_open=True),
    "two_sided": boolean,
    "accuracy_margin": FRACTION,
    "accuracy_alpha": number(0, 0.5, low_open=True),
    "flips_ratio": RATIO,
    "min_flip_allowance": FRACTION,
    "flip_rule": text(FLIP_RULES),
    "flip_alpha": number(0, 0.5, low_open=True),
    "min_baseline_accuracy": FRACTION,
    "expected_accuracy": FRACTION,
    "expected_accuracy_se": number(0, low_open=True),
    "expected_protocol": expected_protocol,
    "max_length_drift": number(0, low_open=True),
    "max_invalid_increase": FRACTION,
    "min_recovery": POSITIVE_FRACTION,
    "max_truncation_increase": FRACTION,
}
DECODE_CHECKS = {"prompts": integer(1), "prompt_tokens": integer(1), "new_tokens": integer(1)}
DECODE_KEYS = (*DECODE_CHECKS, "limits")
DECODE_LIMIT_CHECKS = {
    **FIDELITY_LIMIT_CHECKS,
    "max_gap_kl": number(0),
    "floor_ratio": RATIO,
    "gap_ratio": RATIO,
    "limit_se": number(0),
}
DECODE_METRIC_LIMITS = tuple(rule.limit_key for rule in BY_KIND[Kind.DECODE])
SPEED_CHECKS = {
    "input_len": integer(1),
    "output_len": integer(1),
    "batch_size": integer(1),
    "warmup_iters": integer(0),
    "iters": integer(1),
    "min_iters": integer(2),
    "target_rel_se": FRACTION,
    "rule": text(SPEED_RULES),
    "min_share_of_baseline": POSITIVE_FRACTION,
    "min_fraction_of_ceiling": POSITIVE_FRACTION,
    "overhead_bound_below": FRACTION,
    "min_ratio_overhead_bound": number(0, low_open=True),
    "gpu": text(),
    "bandwidth_gbps": number(0),
}
LOAD_CHECKS = {
    "concurrencies": concurrencies,
    "requests": integer(1),
    "input_len": integer(1),
    "output_len": integer(2),  # TPOT needs a second token
    "min_throughput_fraction": number(0, low_open=True),
    "max_ttft_p99_s": number(0, low_open=True),
    "max_tpot_p99_s": number(0, low_open=True),
}
SPECULATIVE_CHECKS = {"min_acceptance_ratio": number(0, low_open=True), "min_drafts": integer(1)}
