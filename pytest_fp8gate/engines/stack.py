"""What vLLM selected for an engine: its model runner, attention backend, compile and CUDA-graph
mode, and the quantization method and kernel of each linear layer (the stack fingerprint).

A setting can be accepted and then served otherwise: with ``VLLM_TEST_FORCE_FP8_MARLIN=1``
vLLM 0.26 serves an FP8 W8A8 checkpoint through the weight-only Marlin kernel. So the
layers are read from the running model, in the worker (``collective_rpc``). An
in-process engine core runs its worker in this process; a child-process core needs
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (in the model's ``env`` table) to take a function,
and without it the fingerprint says so instead of guessing.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from collections import Counter
from typing import Any

RPC_TIMEOUT_S = 120.0
# Kernel libraries vLLM selects among; their versions change what computes a number.
_KERNEL_DISTRIBUTIONS = ("flashinfer-python", "deep-gemm", "deep_gemm", "triton", "vllm-flash-attn", "flash-attn",
                         "xformers", "intel-extension-for-pytorch")
# VLLM_* variables that select no kernel or backend (logging, ports, timeouts, telemetry, the gate's
# own in-process switch, which the cache key holds as in_process).
_NOT_SELECTING = ("VLLM_LOGGING_", "VLLM_CONFIGURE_LOGGING", "VLLM_CACHE_ROOT", "VLLM_HOST_IP", "VLLM_PORT",
                  "VLLM_RPC_", "VLLM_API_KEY", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "VLLM_USAGE_",
                  "VLLM_ENGINE_READY_TIMEOUT_S", "VLLM_ALLOW_INSECURE_SERIALIZATION", "VLLM_ENABLE_V1_MULTIPROCESSING")
# Kernel names that serve FP8 weights without FP8 activations (the matmul runs in BF16/FP16).
_WEIGHT_ONLY_MARKS = ("marlin", "w8a16", "wna16", "weightonly", "weight_only")


def _name(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return cls.__name__


def _enum(value: Any) -> str:
    """An enum by its name (CompilationMode is an IntEnum: str() would give "0")."""
    return str(getattr(value, "name", value))


def _kernels(*owners: Any) -> list[str]:
    """Class names of the kernel objects a quantization method or scheme holds (one level deep)."""
    found = []
    for owner in owners:
        if owner is None:
            continue
        for attr, value in vars(owner).items():
            kind = _name(value)
            if kind.endswith("Kernel") or attr in ("kernel", "fp8_linear", "linear_kernel"):
                found.append(kind)
        if getattr(owner, "use_marlin", False) is True:
            found.append("Marlin (use_marlin)")
    return sorted(set(found))


def worker_stack(worker: Any) -> dict[str, Any]:
    """Runs in a vLLM worker: its model runner, attention backends and linear layers' methods."""
    runner = getattr(worker, "model_runner", None)
    model = getattr(runner, "model", None)
    modules = list(model.modules()) if model is not None else []
    backends = sorted({_name(b) if not hasattr(b, "get_name") else str(b.get_name())
                       for m in modules if (b := getattr(m, "attn_backend", None)) is not None})
    layers: Counter[str] = Counter()
    for module in modules:
        method = getattr(module, "quant_method", None)
        if method is None or "Linear" not in _name(module) and "MoE" not in _name(module):
            continue
        scheme = getattr(module, "scheme", None)
        parts = [_name(method)] + ([_name(scheme)] if scheme is not None else [])
        kernels = _kernels(method, scheme)
        layers[" / ".join(parts) + (f" [{', '.join(kernels)}]" if kernels else "")] += 1
    return {"model_runner": f"{type(runner).__module__}.{type(runner).__qualname__}" if runner is not None else None,
            "attention_backends": backends, "linear_layers": dict(sorted(layers.items()))}


def fingerprint(llm: Any) -> dict[str, Any]:
    """The stack fingerprint of a started ``vllm.LLM``."""
    config = llm.llm_engine.vllm_config
    compilation = config.compilation_config
    found: dict[str, Any] = {
        "compilation_mode": _enum(getattr(compilation, "mode", getattr(compilation, "level", None))),
        "cudagraph_mode": _enum(getattr(compilation, "cudagraph_mode", None)),
        "enforce_eager": bool(config.model_config.enforce_eager),
        "attention_backend_asked": str(getattr(getattr(config, "attention_config", None), "backend", None)),
    }
    try:
        workers = llm.llm_engine.collective_rpc(worker_stack, timeout=RPC_TIMEOUT_S)
    except Exception as err:  # a child-process core refuses functions unless insecure serialization is on
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        found["workers_unread"] = (f"{type(err).__name__}: {first} (an in-process engine, deterministic_scheduling, "
                                   "or VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the model's env lets the gate read them)")
        return found
    found.update(workers[0])
    return found


def selection_inputs() -> dict[str, Any]:
    """What selects this process's stack before an engine starts (the fingerprint itself is read from a
    running engine): the VLLM_* variables that pick kernels and backends (VLLM_ATTENTION_BACKEND,
    VLLM_USE_DEEP_GEMM, VLLM_TEST_FORCE_FP8_MARLIN, ...), each value hashed as it may be a secret, and
    the versions of the kernel libraries installed. vLLM's version, the GPU and the engine kwargs
    (attention_backend, compilation_config) are keyed beside it."""
    env = {name: hashlib.sha256(value.encode()).hexdigest()[:16] for name, value in sorted(os.environ.items())
           if name.startswith("VLLM_") and not name.startswith(_NOT_SELECTING)}
    kernels = {}
    for name in _KERNEL_DISTRIBUTIONS:
        try:
            kernels[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {"vllm_env_sha256": env, "kernel_libraries": kernels}


def summary(stack: dict[str, Any] | None) -> str:
    """One line: runner, attention, compile and CUDA graphs, and the linear layers' kernels."""
    if not stack:
        return "not recorded"
    runner = (stack.get("model_runner") or "?").rsplit(".", 1)[-1]
    parts = [f"runner {runner}" if "workers_unread" not in stack else "workers not read",
             f"attention {', '.join(stack.get('attention_backends') or ['?'])}",
             f"compile {stack.get('compilation_mode')}", f"CUDA graphs {stack.get('cudagraph_mode')}"]
    parts += [f"{count} x {layer}" for layer, count in stack.get("linear_layers", {}).items()]
    return "; ".join(parts)


def served_otherwise(stack: dict[str, Any]) -> str | None:
    """"served weight-only: ..." when a weight-only kernel serves any linear layer, else None."""
    layers = {layer: count for layer, count in stack.get("linear_layers", {}).items()
              if any(mark in layer.lower() for mark in _WEIGHT_ONLY_MARKS)}
    if not layers:
        return None
    total = sum(stack.get("linear_layers", {}).values())
    return (f"served weight-only: {sum(layers.values())} of {total} linear layers through "
            f"{'; '.join(layers)}, so the activations were not FP8")
