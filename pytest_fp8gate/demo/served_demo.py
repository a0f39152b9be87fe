"""``fp8gate demo --serve``: the demo's models as ``vllm serve`` command lines instead of in-process engines.

Each model table of the demo thresholds becomes ``serve = "vllm serve MODEL --flag ..."``
with its engine keys as the flags vLLM's CLI spells them, so the served demo gates the same
weights with the same settings over HTTP; every other section stays as shipped.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text
from ..config import load_config
from ..spec import ModelSpec

CANDIDATES_MARK = "# --- candidates ---"


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


def served_config_text(text: str, workdir: Path) -> str:
    """The demo thresholds ``text`` with every model table served."""
    draft = workdir / "thresholds.in-process.toml"
    atomic_write_text(draft, text)
    config = load_config(draft)
    head, rest = text.split("[baseline]", 1)
    middle = rest[rest.index("[noise]"):rest.index(CANDIDATES_MARK)]
    tables = [_table("[baseline]", config.baseline)]
    tables += [_table("[[candidates]]", spec) for spec in config.candidates]
    return head + "\n".join(tables) + "\n" + middle + CANDIDATES_MARK + " (served)\n"


def _table(header: str, spec: ModelSpec) -> str:
    return f'{header}\nname = "{spec.name}"\nserve = "{serve_command(spec)}"\n'
