"""Where the embedded tiny model, its lm-eval task and its corpus live.

They ship inside the package (``assets/``, described in ``assets/README.md``)
so the gate can be exercised end to end offline, without a GPU or a download.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["EmbeddedAssets", "TASK_NAME", "embedded_assets"]

TASK_NAME = "fp8gate_tiny_arith"
_ROOT = Path(__file__).resolve().parents[2] / "assets"


@dataclass(frozen=True)
class EmbeddedAssets:
    model: Path  # Hugging Face checkpoint directory (BF16 safetensors, configs, tokenizer)
    tasks: Path  # lm-eval include_path: the directory holding the task folders
    task: str  # lm-eval task name to run from ``tasks``
    corpus: Path  # plain text for the probability check

    def as_dict(self) -> dict[str, str]:
        return {
            "model": str(self.model),
            "tasks": str(self.tasks),
            "task": self.task,
            "corpus": str(self.corpus),
        }


def embedded_assets() -> EmbeddedAssets:
    """Absolute paths of the assets shipped with the package."""
    return EmbeddedAssets(
        model=_ROOT / "model",
        tasks=_ROOT / "tasks",
        task=TASK_NAME,
        corpus=_ROOT / "corpus.txt",
    )
