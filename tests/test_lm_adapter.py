"""The generation budget: thresholds.toml's max_gen_toks is honoured even when the task YAML sets its own."""

from __future__ import annotations

import pytest

from pytest_fp8gate.run.lm_adapter import DEFAULT_MAX_GEN_TOKS, generation_budget


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
