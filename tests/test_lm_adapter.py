"""The lm-eval edge: thresholds.toml's max_gen_toks is honoured even when the task YAML sets its own, and a task
pass leaves the gate's process without a CUDA context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.utils.collect_env
from lm_eval import evaluator

from fakes import QUESTIONS, FakeEngine, write_gate
from pytest_fp8gate.config.spec import ModelSpec, TaskSpec
from pytest_fp8gate.core.dumps import read_lm_eval_samples
from pytest_fp8gate.engines.base import ALL_AT_ONCE
from pytest_fp8gate.run.lm_adapter import DEFAULT_MAX_GEN_TOKS, generation_budget, run_task
from pytest_fp8gate.run.lm_tasks import task_manager


@pytest.mark.parametrize(
    "task_kwargs, configured, expected",
    [
        ({"max_gen_toks": 512, "until": ["\n"]}, 64, 64),  # the task YAML sets its own: the config still wins
        ({"max_gen_toks": 512}, None, 512),
        ({}, 64, 64),
        ({}, None, DEFAULT_MAX_GEN_TOKS),
    ],
    ids=["config-over-task", "task", "config", "default"],
)
def test_generation_budget(task_kwargs: dict, configured: int | None, expected: int) -> None:
    assert generation_budget(task_kwargs, configured) == expected


def test_a_task_pass_leaves_out_torchs_environment_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # lm-eval's simple_evaluate ends with torch's environment report, which calls torch.cuda.init() in the
    # gate's process where a GPU is visible: vLLM then spawns every later engine core instead of forking it.
    # No GPU here, so the report itself is watched: a real lm-eval task pass must not ask for it.
    asked: list[str] = []
    monkeypatch.setattr(torch.utils.collect_env, "get_pretty_env_info", lambda: asked.append("report") or "")
    hook = evaluator.add_env_info
    write_gate(tmp_path)
    task = TaskSpec("echo", "fp8gate_fake_echo", "exact_match", filter="strict-match",
                    include_path=tmp_path / "tasks")
    engine = FakeEngine(ModelSpec("bf16", "org/base", None, {}), max_logprobs=5)
    samples = run_task(engine, task, tmp_path, task_manager([task]), "run", ALL_AT_ONCE)
    assert len(read_lm_eval_samples(samples, "strict-match", "exact_match")) == QUESTIONS
    assert asked == []
    assert evaluator.add_env_info is hook  # lm-eval's own hook is back after the pass
