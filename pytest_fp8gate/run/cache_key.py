"""The baseline cache's key: everything that changes the baseline's numbers, as one JSON document, its
digest (an entry's name) and the keys two documents differ in (a stale entry's reason).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..config.spec import GateConfig, LoadSpec
from ..engines import provenance, stack
from .record import Needs

FORMAT = 1  # bump when the entry layout or the meaning of a stored number changes

# What of [speed] is measured, not the limit or the bandwidth it is judged against.
SPEED_KEY = ("input_len", "output_len", "batch_size", "warmup_iters", "iters", "min_iters", "target_rel_se")


def baseline_key(config: GateConfig, needs: Needs, engine_settings: dict[str, Any],
                 model: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes the baseline's numbers, as one JSON document."""
    environment = provenance.environment()
    devices = {k: v for k, v in environment["devices"].items() if k != "cuda_visible_devices"}
    probabilities = config.probabilities
    speed = config.speed
    key = {
        "format": FORMAT,
        "model": _portable_model(model),
        # An env table joins the key only when there is one, so that existing entries keep theirs;
        # its values hashed, as they may hold secrets (HF_TOKEN) and the key is written to disk.
        "engine": {"kwargs": config.baseline.engine, **engine_settings,
                   **({"env_sha256": _env_hash(config.baseline.env)} if config.baseline.env else {})},
        "versions": environment["versions"],
        "devices": devices,
        # What picks the kernels and backends (stack.py): another one measures the baseline again.
        "stack": stack.selection_inputs(),
        "noise_passes": list(config.noise.passes),
        "needs": {"probabilities": needs.probabilities, "tasks": sorted(needs.tasks), "speed": needs.speed},
        "probabilities": None if probabilities is None or not needs.probabilities else {
            "corpus": _without(provenance.corpus_fingerprint(probabilities.corpus), "file"),
            "chunks": probabilities.chunks,
            "chunk_tokens": probabilities.chunk_tokens, "top_k": probabilities.top_k,
        },
        "tasks": [_without(provenance.task_fingerprint(t), "include_path") for t in config.tasks
                  if t.name in needs.tasks],
        "speed": {name: getattr(speed, name) for name in SPEED_KEY} if speed is not None and needs.speed else None,
        # Like env: only when measured, so that entries without load keep their keys.
        **({"load": _load_key(config.load)} if config.load is not None and needs.load else {}),
    }
    if probabilities is not None and needs.probabilities and probabilities.measured_references:
        key["references"] = list(probabilities.measured_references)  # as decode: only when measured
    if needs.speculative:  # as decode: only then, so existing entries keep their keys
        key["needs"]["speculative"] = True
    if needs.decode and config.decode is not None:  # joins the key only then, so existing entries keep theirs
        key["needs"]["decode"] = True
        key["decode"] = {name: getattr(config.decode, name) for name in ("prompts", "prompt_tokens", "new_tokens")}
    return key


def _load_key(load: LoadSpec) -> dict[str, Any]:
    """What of [load] is measured (not its limits): the levels, their requests and lengths."""
    return {"concurrencies": list(load.concurrencies), "requests": [load.requests_at(c) for c in load.concurrencies],
            "input_len": load.input_len, "output_len": load.output_len}


# Local files are keyed by their content, not where they are, so that a cache (or a committed
# directory) serves checkouts at other paths.
def _without(fingerprint: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in fingerprint.items() if k != name}


def _env_hash(env: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(env.items())).encode()).hexdigest()


def _portable_model(model: dict[str, Any]) -> dict[str, Any]:
    if model.get("weights_sha256") and Path(model["model"]).is_dir():
        return dict(model, model=f"local checkpoint {Path(model['model']).name}")
    return model


def key_digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(provenance.as_json(key).encode()).hexdigest()


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    items: Iterable[tuple[Any, Any]]
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for name, item in items:
        flat.update(_flatten(item, f"{prefix}.{name}" if prefix else str(name)))
    return flat


def key_differences(stored: dict[str, Any], wanted: dict[str, Any]) -> list[str]:
    """Dotted keys whose values differ, e.g. ``versions.vllm``, ``tasks.0.files_sha256``."""
    a, b = _flatten(json.loads(provenance.as_json(stored))), _flatten(json.loads(provenance.as_json(wanted)))
    return sorted(name for name in a.keys() | b.keys() if a.get(name) != b.get(name))
