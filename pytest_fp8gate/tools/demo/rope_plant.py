"""The RoPE-base plant: a real engine fault whose error grows with position. The candidate's RoPE base
(vLLM ``hf_overrides``, rope_theta) differs from the embedded checkpoint's 10,000, so every rotation angle is
off by position x the frequency difference; the null goes through the same override with the checkpoint's own
rope_theta. ``gate_config`` writes the thresholds file that scores the demo's corpus in 2 chunks of 2,000
tokens against the demo's probability limits (benchmarks/position_buckets.py, the bucket rules' engine test)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...config.loader import load_config
from ...config.spec import GateConfig
from .embedded import embedded_assets

__all__ = ["CHECKPOINT_THETA", "PLANTS", "candidate_name", "gate_config", "q8_row_only"]

CHECKPOINT_THETA = 10000.0  # the embedded model's rope_parameters.rope_theta
PLANTS = (10700.0, 11500.0)

CONFIG = """
device = "cpu"
deterministic_scheduling = {deterministic}

[baseline]
name = "bf16"
model = "{model}"
[baseline.engine]
dtype = "bfloat16"
max_model_len = 2048
enforce_eager = true
kv_cache_memory_bytes = 1073741824

[noise]
passes = {passes}

[probabilities]
corpus = "{corpus}"
chunks = 2
chunk_tokens = 2000
top_k = 20
full_vocab = true
[probabilities.limits]
per_bucket = true
min_same_top = 0.97674
max_rms_dp = 0.01198
max_mean_kl = 0.001355
max_ppl_ratio = 1.000425
limit_se = 1.0
floor_ratio = {{ mean_kl = 20 }}
"""
# A candidate with the baseline's engine settings; CANDIDATE adds the RoPE base it runs at.
PLAIN_CANDIDATE = """
[[candidates]]
name = "{name}"
model = "{model}"
[candidates.engine]
dtype = "bfloat16"
max_model_len = 2048
enforce_eager = true
kv_cache_memory_bytes = 1073741824
"""
CANDIDATE = PLAIN_CANDIDATE + ('hf_overrides = {{ rope_parameters = {{ rope_theta = {theta}, '
                               'rope_type = "default" }} }}\n')


def candidate_name(theta: float) -> str:
    return "rope-null" if theta == CHECKPOINT_THETA else f"rope-theta-{theta:g}"


def gate_config(directory: Path, thetas: tuple[float, ...] = (CHECKPOINT_THETA, *PLANTS),
                passes: str = '["batch-order", "fp16"]', deterministic: bool = True) -> GateConfig:
    """The thresholds file above with one candidate per RoPE base in ``thetas``, loaded. ``deterministic``
    runs the engines in this process (vLLM allows that only before any child-process engine started here)."""
    assets = embedded_assets()
    text = CONFIG.format(model=assets.model.as_posix(), corpus=assets.corpus.as_posix(), passes=passes,
                         deterministic=str(deterministic).lower())
    for theta in thetas:
        text += CANDIDATE.format(name=candidate_name(theta), model=assets.model.as_posix(), theta=theta)
    path = directory / "thresholds.toml"
    path.write_text(text)
    return load_config(path)


def q8_row_only(config: GateConfig) -> GateConfig:
    """The same limits without floor_ratio: llama.cpp's Q8_0 row alone."""
    assert config.probabilities is not None
    limits = dataclasses.replace(config.probabilities.limits, floor_ratio=None)
    return dataclasses.replace(config, probabilities=dataclasses.replace(config.probabilities, limits=limits))
