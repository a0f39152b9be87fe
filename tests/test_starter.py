"""`fp8gate init`: a commented thresholds file that the loader reads as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.tools import cli
from pytest_fp8gate.tools.demo.embedded import embedded_assets

MODEL = embedded_assets().model


def test_a_local_model_gets_its_context_and_each_models_roofline(tmp_path: Path, capsys) -> None:
    path = tmp_path / "thresholds.toml"
    assert cli.main(["init", str(MODEL), "--candidate", "fp8_per_tensor", "--candidate", "fp8_per_channel",
                     "--gpu", "H100 PCIe", "--output", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}\n"
    gate = load_config(path)
    assert gate.baseline.model == str(MODEL) and gate.baseline.engine["max_model_len"] == 2048  # its context
    assert [(c.name, c.quantization) for c in gate.candidates] == [
        ("online-fp8-per-tensor", "fp8_per_tensor"), ("online-fp8-per-channel", "fp8_per_channel")]
    assert gate.probabilities is not None and gate.probabilities.chunk_tokens == 2047
    assert gate.noise.passes == ("batch-order",) and [task.task for task in gate.tasks] == ["gsm8k"]
    assert gate.speed is not None and gate.speed.gpu == "H100 PCIe" and gate.speed.input_len == 1000
    rooflines = [line for line in path.read_text().splitlines() if "read per decoded token" in line]
    assert [line.split(":")[0] for line in rooflines] == ["# bf16", "# online-fp8-per-tensor",
                                                          "# online-fp8-per-channel"]
    assert all(line.endswith("tok/s on one H100 PCIe") for line in rooflines)
    assert cli.main(["init", str(MODEL), "--output", str(path)]) == cli.EXIT_ERROR  # never over a file
    assert capsys.readouterr().err == f"fp8gate: error: {path}: exists; give another path (--output) or remove it\n"


def test_a_hub_model_not_on_this_machine_and_a_cpu(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.toml"
    cli.main(["init", "org/not-downloaded", "--candidate", "org/not-downloaded-FP8", "--output", str(path)])
    gate = load_config(path)
    assert [(c.name, c.model, c.quantization) for c in gate.candidates] == [
        ("not-downloaded-fp8", "org/not-downloaded-FP8", None)]
    assert gate.baseline.engine["max_model_len"] == 4096 and gate.speed is not None and gate.speed.gpu == "auto"
    assert "# bf16: no roofline here (org/not-downloaded is not on this machine" in path.read_text()
    cpu = tmp_path / "cpu.toml"
    cli.main(["init", str(MODEL), "--device", "cpu", "--output", str(cpu)])
    gate = load_config(cpu)
    assert gate.device == "cpu" and gate.noise.passes == ("batch-order", "fp32") and gate.speed is None


@pytest.mark.parametrize("args, message", [
    (["--gpu", "MI300X"], "speed.gpu: unknown GPU 'MI300X'"),
    (["--candidate", "fp8"], 'candidates[0].quantization: plain "fp8" is deprecated'),
])
def test_arguments_the_loader_refuses_write_nothing(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    path = tmp_path / "thresholds.toml"
    assert cli.main(["init", str(MODEL), *args, "--output", str(path)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert message in err and err.rstrip().endswith("(from fp8gate init's arguments; nothing written)")
    assert not path.exists()
