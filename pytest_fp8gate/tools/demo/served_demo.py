"""``fp8gate demo --serve``: the demo's models as ``vllm serve`` command lines instead of in-process engines.

Each model table of the demo thresholds becomes ``serve = "vllm serve MODEL --flag ..."``
with its engine keys as the flags vLLM's CLI spells them, so the served demo gates the same
weights with the same settings over HTTP; every other section stays as shipped.
"""

from __future__ import annotations

import shlex
from typing import Any

from ...config.spec import GateConfig, ModelSpec

IN_PROCESS_KEYS = ("name", "model", "quantization", "engine")  # a serve command says these


def serve_command(spec: ModelSpec) -> str:
    """``vllm serve`` for an in-process model spec: its engine keys as CLI flags (true: the bare flag)."""
    words = ["vllm", "serve", spec.model]
    settings: dict[str, Any] = {**spec.engine, "quantization": spec.quantization}
    for key, value in settings.items():
        if value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        words += [flag] if value is True else [flag, str(value)]
    return shlex.join(words)


def served_config(document: dict[str, Any], config: GateConfig) -> dict[str, Any]:
    """The demo thresholds ``document`` with every model table served: the command in place of
    ``model``, ``quantization`` and ``engine`` (loaded as ``config``, so merged and resolved), the
    rest of each table as it was."""
    def served(table: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
        kept = {key: value for key, value in table.items() if key not in IN_PROCESS_KEYS}
        return {"name": spec.name, "serve": serve_command(spec), **kept}

    candidates = zip(document["candidates"], config.candidates, strict=True)
    return {**document, "baseline": served(document["baseline"], config.baseline),
            "candidates": [served(table, spec) for table, spec in candidates]}
