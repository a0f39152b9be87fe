"""The README's thresholds file is one a new user can copy: it loads, and it asks for every check. So does
the repository's own thresholds.toml, the example for GPU runners."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import WIKITEXT_2

README = Path(__file__).parent.parent / "README.md"
GPU_EXAMPLE = Path(__file__).parent.parent / "thresholds.toml"


def test_the_readme_thresholds_file_loads(tmp_path: Path) -> None:
    block, _ = _toml_blocks()
    path = tmp_path / "thresholds.toml"
    path.write_text(block, encoding="utf-8")
    gate = load_config(path)
    assert gate.baseline.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert [(c.name, c.model, c.quantization) for c in gate.candidates] == [
        ("fp8-dynamic", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", None),
        ("fp8-online", "meta-llama/Llama-3.1-8B-Instruct", "fp8_per_channel"),
    ]
    assert gate.probabilities is not None and gate.probabilities.corpus == WIKITEXT_2
    assert [t.task for t in gate.tasks] == ["gsm8k"] and gate.speed is not None
    assert len(block.splitlines()) <= 25


def test_the_gpu_runners_example_loads() -> None:
    # The suite's own runs leave the gate out (pyproject.toml's addopts), so none loads this file on the way.
    gate = load_config(GPU_EXAMPLE)
    assert gate.baseline.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert [c.name for c in gate.candidates] == ["fp8-dynamic", "fp8-per-tensor", "fp8-online-per-channel"]
    assert gate.probabilities is not None and [t.name for t in gate.tasks] == ["gsm8k"] and gate.speed is not None


def test_the_readme_served_example_loads(tmp_path: Path) -> None:
    _, block = _toml_blocks()
    path = tmp_path / "thresholds.toml"
    path.write_text(block, encoding="utf-8")
    gate = load_config(path)
    assert gate.baseline.served is not None and gate.baseline.served.command[0] == "serve"
    (candidate,) = gate.candidates
    assert candidate.served is not None and candidate.served.endpoint == "https://llm-fp8.internal:8443"
    assert gate.load is not None and gate.load.concurrencies == (1, 8, 64)


def _toml_blocks() -> list[str]:
    """The README's two TOML examples: the minimal thresholds file, then the served one."""
    blocks = re.findall(r"```toml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.DOTALL)
    assert len(blocks) == 2, blocks
    return blocks
