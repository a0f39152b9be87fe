"""Answers cut by length: each answer's finish_reason in the samples, and the truncation rule, which a
build writing longer answers under a tight max_gen_toks fails (fake engine; the served engine's
finish_reason over a fake endpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_endpoint import FakeEndpoint, Knobs
from fakes import FakeModel, build_measurements, fake_engine_class, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.dumps import FINISH_REASON
from pytest_fp8gate.errors import GateError
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.record import Needs
from pytest_fp8gate.tools.demo.embedded import embedded_assets

MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),
    # Thinks aloud for 60 characters before its answer: past the echo task's 64-token budget.
    "bad": FakeModel(logit_noise=0.004, seed=3, ramble=60),
}


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    tmp_path = tmp_path_factory.mktemp("truncation")
    path = write_gate(tmp_path, lambda text: text.replace(
        "flip_alpha = 0.5\n", "flip_alpha = 0.5\nmax_truncation_increase = 0.02\n"))
    config = load_config(path)
    measurements = build_measurements(config, tmp_path / "artifacts",
                                     {name: Needs(tasks=frozenset({"echo"})) for name in MODELS},
                                     fake_engine_class(MODELS))
    return Gate(config, measurements)


def test_each_answer_s_finish_reason_is_in_the_samples(gate: Gate) -> None:
    measured = gate.measurements
    for result, reason in ((measured.baseline(), "stop"), (measured.candidate("bad"), "length")):
        rows = [json.loads(line) for line in Path(result.main.samples["echo"]).read_text().splitlines()]
        assert rows and {row[FINISH_REASON] for row in rows} == {reason}


def test_longer_answers_under_a_tight_budget_fail_and_the_baseline_s_length_passes(gate: Gate) -> None:
    good = gate.evaluate(Case(rules.TRUNCATION, "good", "echo"))
    bad = gate.evaluate(Case(rules.TRUNCATION, "bad", "echo"))
    assert good.passed and good.outcome.measured == 0, good.explain()
    assert not bad.passed and bad.outcome.measured == 1, bad.explain()
    rows = dict(bad.outcome.rows)
    assert rows["cut in the candidate only"] == 40 and rows["baseline cut by length"] == 0
    text = bad.explain()
    assert 'finish_reason "length"' in text and text.splitlines()[-1].endswith(
        "tasks[0].limits.max_truncation_increase = 0.02")


def test_the_rule_weighs_both_counts_uncertainty() -> None:
    # Baseline 4 of 100 cut, candidate 8: rates 0.04 and 0.08, limit 0.04 + 0.02 = 0.06; the SE of two runs
    # with no change, sqrt(2 x 0.04 x 0.96 / 100) = 0.0277 (not the candidate's own): 0.02 over is within it.
    outcome = rules.truncation_within(0.04, 0.08, None, 100, 0.02, 1.0)
    assert outcome.passed and outcome.margin == pytest.approx(0.06 - 0.08 + 0.0277, abs=1e-4)
    assert not rules.truncation_within(0.04, 0.09, None, 100, 0.02, 1.0).passed
    # A noise pass that itself cuts more widens the allowance, and says so.
    widened = rules.truncation_within(0.04, 0.12, 0.10, 100, 0.02, 1.0)
    assert widened.passed and widened.bound_by == "noise floor"


def test_samples_without_finish_reasons_are_refused_by_name(gate: Gate, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    # A stripped copy in the candidate's place, for this test only: the module's other tests read the samples.
    samples = gate.measurements.candidate("good").main.samples
    rows = [json.loads(line) for line in Path(samples["echo"]).read_text().splitlines()]
    stripped = tmp_path / "samples_echo.jsonl"
    stripped.write_text("".join(json.dumps({k: v for k, v in row.items() if k != FINISH_REASON}) + "\n"
                                for row in rows))
    monkeypatch.setitem(samples, "echo", stripped)
    fresh = Gate(gate.config, gate.measurements)
    with pytest.raises(GateError, match=r"candidate good on echo: cannot count answers cut by length: .*"
                                        r"'finish_reason' field"):
        fresh.evaluate(Case(rules.TRUNCATION, "good", "echo"))


def test_the_served_engine_reads_the_choice_s_finish_reason() -> None:
    from pytest_fp8gate.config.spec import ModelSpec, ServedSpec
    from pytest_fp8gate.engines.vllm_served import VllmServedEngine

    with FakeEndpoint(Knobs()) as url:
        spec = ModelSpec("bf16", embedded_assets().model.as_posix(), None, {},
                         served=ServedSpec("served-bf16", endpoint=url))
        engine = VllmServedEngine(spec, max_logprobs=5)
        generations = engine.generate_greedy([[1, 2, 3]], [4], [[]])
        engine.shutdown()
    assert [g.finish_reason for g in generations] == ["length"]  # the fake endpoint's choice says so
