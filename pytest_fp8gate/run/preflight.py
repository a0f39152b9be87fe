"""Checks of the machine the rules run on, made just before the session's first engine starts.

The thresholds file itself is checked at load (config/loader.py). These run only once
a rule needs a model, so a project's unit tests beside its thresholds file do
not fail on them, and a missing GPU under --fp8gate-require-gpu is reported first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from .. import hardware
from ..config.spec import GateConfig, ModelSpec
from ..engines import http_client

if TYPE_CHECKING:
    from .record import Needs


def _engine_specs(gate: GateConfig, needs: dict[str, Needs]) -> dict[str, ModelSpec]:
    """The models an engine will load, by their key in the thresholds file: the baseline
    and every candidate a selected rule needs."""
    specs = {"baseline": gate.baseline}
    specs |= {f"candidates[{i}]": spec for i, spec in enumerate(gate.candidates) if spec.name in needs}
    return specs


def machine_problem(gate: GateConfig, needs: dict[str, Needs]) -> str | None:
    """The first problem of the machine before the session's first engine: an endpoint's key, then the GPUs
    a model asks for (``parallelism_problem`` on the visible ones); None when there is none."""
    keys = key_problems(gate, needs)
    return keys[0] if keys else parallelism_problem(gate, len(hardware.cuda_device_names()), needs)


def key_problems(gate: GateConfig, needs: dict[str, Needs]) -> list[str]:
    """Each endpoint's key variable (api_key_env) unset or empty, before the first engine or request.

    Every model's key that is set is remembered first, so each is blanked in whatever any server sends back."""
    for spec in (gate.baseline, *gate.candidates):
        if spec.served is not None and spec.served.api_key_env is not None:
            http_client.remember_secret(os.environ.get(spec.served.api_key_env, ""))
    return [f"{gate.path}: {where}.api_key_env: the environment variable {spec.served.api_key_env} is not set or "
            f"empty; set it to the API key of {spec.name}'s endpoint"
            for where, spec in _engine_specs(gate, needs).items()
            if spec.served is not None and spec.served.api_key_env is not None
            and not os.environ.get(spec.served.api_key_env)]


def hub_problem(gate: GateConfig, needs: dict[str, Needs]) -> str | None:
    """Offline, every Hugging Face id an engine will load must already be in the cache; else why not."""
    from huggingface_hub import constants, try_to_load_from_cache

    if not constants.is_offline_mode():
        return None
    for where, spec in _engine_specs(gate, needs).items():
        if Path(spec.model).is_absolute():
            continue
        cached = try_to_load_from_cache(spec.model, "config.json", revision=spec.engine.get("revision"))
        if not isinstance(cached, str):
            return (f"{gate.path}: {where}.model: {spec.model!r} is not in the Hugging Face cache and "
                    f"HF_HUB_OFFLINE is set; download it first (hf download {spec.model}) or unset HF_HUB_OFFLINE")
    return None


def parallelism_problem(gate: GateConfig, visible_gpus: int, needs: dict[str, Needs]) -> str | None:
    """A CUDA model asks for more GPUs than this host shows; else None.

    vLLM places tensor x pipeline (x data) parallel ranks on the visible devices. A Ray
    backend may place them on other nodes of its cluster, so those specs are not
    counted against this host.
    """
    if gate.device != "cuda":
        return None
    for where, spec in _engine_specs(gate, needs).items():
        if spec.engine.get("distributed_executor_backend") == "ray":
            continue
        sizes = {key: int(spec.engine.get(key, 1))
                 for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")}
        wanted = sizes["tensor_parallel_size"] * sizes["pipeline_parallel_size"] * sizes["data_parallel_size"]
        # No GPU at all is --fp8gate-require-gpu's business (gpu rules skip or fail there).
        if wanted > max(visible_gpus, 1):
            product = " x ".join(f"{key} {value}" for key, value in sizes.items() if value > 1)
            return (f"{gate.path}: {where}.engine: {product} needs {wanted} GPUs, but {visible_gpus} "
                    f"{'is' if visible_gpus == 1 else 'are'} visible; lower the sizes, widen CUDA_VISIBLE_DEVICES, "
                    'or use distributed_executor_backend = "ray" with a Ray cluster')
    return None
