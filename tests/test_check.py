"""`fp8gate check`: every check that needs no engine, one line per problem, in seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import thresholds_text
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.tools import cli
from pytest_fp8gate.tools.check import check_thresholds
from pytest_fp8gate.tools.demo.embedded import embedded_assets

ASSETS = embedded_assets()
TASK = f"""[[tasks]]
task = "{ASSETS.task}"
include_path = "{ASSETS.tasks.as_posix()}"
metric = "exact_match"
"""
SPEED = '[speed]\ngpu = "H100"'


def _write(tmp_path: Path, *tables: str, **keys: str) -> Path:
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text(*tables, model=ASSETS.model.as_posix(), **keys))
    return path


def test_a_good_file_passes_and_says_which_card_its_gpu_means(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, TASK, SPEED)
    assert cli.main(["check", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert f"note: {path}: speed.gpu: the H100 SXM (3,350 GB/s, 80 GiB); for the H100 PCIe (2,000 GB/s) write " \
           '"H100 PCIe" or the H100 NVL (3,900 GB/s) write "H100 NVL"' in out
    rooflines = [line for line in out if ": roofline " in line]
    assert [line.split(": ")[2] for line in rooflines] == ["baseline", "candidates[0]"]
    assert "(fp8_per_channel)" in rooflines[1] and "tok/s ceiling on 1 x H100 SXM" in rooflines[1]
    assert out[-1].startswith(f"{path}: no problem found, no engine started (")


def test_each_problem_is_one_line_naming_file_key_and_what_was_expected(tmp_path: Path, capsys,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GATE_KEY", raising=False)
    monkeypatch.setenv("GATE_BASE_KEY", "")
    endpoint = (f'endpoint = "http://127.0.0.1:9"\nserved_model_name = "m"\nmodel = "{ASSETS.model.as_posix()}"\n'
                'api_key_env = "GATE_KEY"')
    path = _write(tmp_path, TASK.replace(ASSETS.task, "fp8gate_tiny_arihm"), candidate=endpoint)
    text = path.read_text().replace(f'model = "{ASSETS.model.as_posix()}"',
                                    f'endpoint = "http://127.0.0.1:8"\nserved_model_name = "b"\n'
                                    f'api_key_env = "GATE_BASE_KEY"\nmodel = "{ASSETS.model.as_posix()}"', 1)
    path.write_text(text)
    assert cli.main(["check", str(path), "--json"]) == cli.EXIT_FAILURE
    assert json.loads(capsys.readouterr().out)["problems"] == [
        f"{path}: baseline.api_key_env: the environment variable GATE_BASE_KEY is not set or empty; set it to the "
        "API key of bf16's endpoint",
        f"{path}: candidates[0].api_key_env: the environment variable GATE_KEY is not set or empty; set it to the "
        "API key of fp8's endpoint",
        f"{path}: tasks[0].task: unknown lm-eval task 'fp8gate_tiny_arihm'; did you mean 'fp8gate_tiny_arith'?",
    ]


def test_weights_that_do_not_fit_the_gpus_given_are_a_problem(tmp_path: Path) -> None:
    big = tmp_path / "llama-70b"  # the shape alone: config.json, and weights the roofline does not read
    big.mkdir()
    config = json.loads((ASSETS.model / "config.json").read_text())
    (big / "config.json").write_text(json.dumps({**config, "hidden_size": 8192, "intermediate_size": 28672,
                                                 "num_hidden_layers": 80, "num_attention_heads": 64,
                                                 "num_key_value_heads": 8, "vocab_size": 128256,
                                                 "head_dim": 128}))
    (big / "pytorch_model.bin").write_bytes(b"")
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text('[speed]\ngpu = "L40S"', model=big.as_posix(),
                                    baseline_engine="tensor_parallel_size = 2"))
    # FP8 halves the linear weights: the candidate's fit the two GPUs.
    assert check_thresholds(path).problems == [
        f"{path}: baseline.engine.tensor_parallel_size: the weights (131.4 GiB) do not fit 2 L40S GPUs (48 GiB "
        "each, 43.2 GiB of it at vLLM's gpu_memory_utilization 0.9); tensor_parallel_size = 4 holds them "
        "(32.9 GiB a GPU)",
    ]


def test_a_file_the_loader_refuses_is_that_one_line(tmp_path: Path, capsys) -> None:
    path = _write(tmp_path, "[speed]\ngpu = \"H100\"\nmin_share_of_baseline = 60")
    assert cli.main(["check", str(path)]) == cli.EXIT_FAILURE
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (f"error: {path}: speed.min_share_of_baseline: expected a number in (0, 1], got 60; a "
                      "fraction, not a percent: did you mean 0.6?")
    assert out[1].startswith(f"{path}: 1 problem, no engine started (")


def test_checking_imports_neither_vllm_nor_torch(tmp_path: Path) -> None:
    """No engine, and none of the imports that take seconds: lm-eval's task package (datasets, pandas) only
    where a task file spells the name."""
    path = _write(tmp_path, TASK.replace(ASSETS.task, "fp8gate_tiny_arihm"), SPEED)
    code = ("import sys; from pytest_fp8gate.tools import cli; status = cli.main(['check', sys.argv[1]]); "
            "print(status, *(name in sys.modules for name in ('vllm', 'torch', 'lm_eval.tasks')))")
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1] == "1 False False False", done.stdout + done.stderr


def test_lm_evals_own_tasks_are_looked_up_without_building_their_whole_index(tmp_path: Path) -> None:
    from pytest_fp8gate.run.lm_tasks import TaskNames, task_name_problems

    path = _write(tmp_path, '[[tasks]]\ntask = "gsm8K"\nmetric = "exact_match"')
    gate = load_config(path)
    index = TaskNames(gate.tasks)
    assert "gsm8k" in index and "gsm8K" not in index
    assert task_name_problems(gate, index, index.names) == [
        f"{path}: tasks[0].task: unknown lm-eval task 'gsm8K'; did you mean 'gsm8k'?"]
