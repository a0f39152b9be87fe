"""Reasoning models (issue 34): a task's chat_template_kwargs reach the chat template, only the answer after
think_end is scored, and the answers' rules judge that answer with the thinking length beside them. Fake
engine and fake endpoint; the embedded model under a thinking template is in test_embedded_model.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
from lm_eval.api.instance import Instance
from lm_eval.models.utils import postprocess_generated_text

from fake_endpoint import FakeEndpoint, Knobs
from fakes import THINK_END, THINKING, FakeModel, build_measurements, fake_engine_class, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import ModelSpec, ServedSpec, TaskSpec
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.answers import final_answer, thinking_lengths
from pytest_fp8gate.core.dumps import FINISH_REASON, THINKING_CHARS
from pytest_fp8gate.engines.base import ALL_AT_ONCE
from pytest_fp8gate.engines.provenance import task_fingerprint
from pytest_fp8gate.errors import ConfigError
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.tasks import THINKING as THINKING_DETAILS
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.lm_adapter import EngineLM, run_task
from pytest_fp8gate.run.lm_tasks import task_manager
from pytest_fp8gate.run.record import Needs
from pytest_fp8gate.tools.demo.embedded import embedded_assets

BUDGET = 128  # the echo task's max_gen_toks here: room for the baseline's thinking and answer
MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),
    # Thinks 2.5 times as long as the baseline (16 characters), still within the budget: its answers do not change.
    "long": FakeModel(logit_noise=0.004, seed=2, think=40),
    # Thinks past the budget: every answer ends by length inside the thinking, with no answer written.
    "bad": FakeModel(logit_noise=0.004, seed=3, think=200),
}
REASONING_TASK = (f'apply_chat_template = true\nchat_template_kwargs = {{ enable_thinking = true }}\n'
                  f'think_end = "{THINK_END}"\nmax_gen_toks = {BUDGET}\n[tasks.limits]\n'
                  "max_truncation_increase = 0.02\nmax_length_drift = 0.1\nmax_invalid_increase = 0.02\n")
LONG = '\n[[candidates]]\nname = "long"\nquantization = "fp8_per_channel"\n'


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def _reasoning(text: str) -> str:
    return text.replace("[tasks.limits]\n", REASONING_TASK, 1) + LONG


@pytest.fixture(scope="module")
def gate(tmp_path_factory: pytest.TempPathFactory) -> Gate:
    tmp_path = tmp_path_factory.mktemp("reasoning")
    config = load_config(write_gate(tmp_path, _reasoning))
    measurements = build_measurements(config, tmp_path / "artifacts",
                                     {name: Needs(tasks=frozenset({"echo"})) for name in MODELS},
                                     fake_engine_class(MODELS))
    return Gate(config, measurements)


def _rows(path: Path | str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_answer_is_cut_as_lm_eval_cuts_it() -> None:
    # The same strings through lm-eval's own postprocess_generated_text and the gate's final_answer.
    stops = ["Question:", "\n\n"]
    for text in ["<think>a\n\nb</think> 17\n\nQuestion: next", "x</think>y</think>  z", "no marker\n\nat all",
                 "  spaced 3", "</think>", "cut while thinking: Question: 4"]:
        answer, thinking = final_answer(text, THINK_END, stops)
        assert answer == postprocess_generated_text(text, stops, THINK_END), text
        assert thinking == (text.rindex(THINK_END) + len(THINK_END) if THINK_END in text else None)
    assert final_answer("a\n\nb", None, ["\n\n"]) == ("a", None)
    summary = thinking_lengths([10, None, [20, None]])
    assert (summary.answers, summary.closed, summary.mean_chars) == (4, 2, 15.0)


def test_only_the_answer_after_the_marker_reaches_the_filters(gate: Gate) -> None:
    rows = _rows(gate.measurements.baseline().main.samples["echo"])
    assert rows and {row[THINKING_CHARS] for row in rows} == {16 + len(THINK_END)}
    assert {row[FINISH_REASON] for row in rows} == {"stop"}
    for row in rows:
        # The thinking holds the task's stop strings: the engine was not given them, so the answer survived,
        # and they cut the answer after the thinking was stripped.
        assert row["resps"][0][0].startswith("The number is") and "\n\n" not in row["resps"][0][0], row["resps"]
    comparison, _ = gate.comparisons.answers("good", gate.config.tasks[0])
    assert comparison.accuracy_base > 0.6  # the fake's baseline is wrong on a fifth of the questions


def test_truncation_fails_a_build_cut_off_while_thinking_and_scores_what_it_wrote(gate: Gate) -> None:
    bad = gate.evaluate(Case(rules.TRUNCATION, "bad", "echo"))
    good = gate.evaluate(Case(rules.TRUNCATION, "good", "echo"))
    assert good.passed and good.outcome.measured == 0, good.explain()
    assert not bad.passed and bad.outcome.measured == 1, bad.explain()
    # Cut inside the thinking: no marker, so the text is scored whole (lm-eval's rule) and has no answer.
    rows = _rows(gate.measurements.candidate("bad").main.samples["echo"])
    assert {row[THINKING_CHARS] for row in rows} == {None} and {row[FINISH_REASON] for row in rows} == {"length"}
    comparison, _ = gate.comparisons.answers("bad", gate.config.tasks[0])
    assert comparison.accuracy_cand == 0 and comparison.accuracy_base > 0.6
    assert not gate.evaluate(Case(rules.INVALID_RATE, "bad", "echo")).passed
    thinking = bad.details[THINKING_DETAILS]
    assert thinking["candidate bad"]["closed"] == 0 and thinking["baseline"]["closed"] == len(rows)
    assert "0 of 40 answers closed it" in bad.explain()


def test_a_build_that_thinks_longer_keeps_its_answers_length_and_reports_its_thinking(gate: Gate) -> None:
    verdict = gate.evaluate(Case(rules.LENGTH_DRIFT, "long", "echo"))
    # Its answers after the thinking are the baseline's: no drift, though it writes 2x the characters in all.
    assert verdict.passed and abs(verdict.details["drift"]) < 0.01, verdict.explain()
    thinking = verdict.details[THINKING_DETAILS]
    base, cand = thinking["baseline"]["mean_chars"], thinking["candidate long"]["mean_chars"]
    assert cand / base == pytest.approx((40 + len(THINK_END)) / (16 + len(THINK_END)))
    assert "answers after the thinking" in verdict.explain()
    assert gate.evaluate(Case(rules.TRUNCATION, "long", "echo")).passed


def test_the_report_prints_the_thinking_beside_the_flips(gate: Gate) -> None:
    from pytest_fp8gate.report.markdown_report import ReportData, render

    measured = gate.measurements
    verdict = gate.evaluate(Case(rules.LENGTH_DRIFT, "long", "echo"))
    text = render(ReportData(gate.config, [verdict], measured.record(), {"long": measured.candidate("long")}, {},
                             gate.comparisons), None).markdown
    lines = [line for line in text.splitlines() if line.startswith("Thinking before '</think>'")]
    assert lines[:2] == ["Thinking before '</think>' (not scored): baseline: mean 24.0 characters of thinking, "
                         "40 of 40 answers closed it",
                         "Thinking before '</think>' (not scored): candidate long: mean 48.0 characters of thinking, "
                         "40 of 40 answers closed it"], lines
    assert len(lines) == 2 + len(measured.baseline().noise)


def _instance(context: str, budget: int, index: int = 0) -> Instance:
    return Instance("generate_until", {}, (context, {"until": ["Question:", "\n\n"], "max_gen_toks": budget}),
                    index, ("echo", index, 1))


def test_chat_template_kwargs_reach_the_template() -> None:
    engine = fake_engine_class({"bf16": FakeModel()})(ModelSpec("bf16", "org/base", None, {}), max_logprobs=5)
    turns = [{"role": "user", "content": "Question: Which number is 17?\nAnswer:"}]
    for enabled, think in ((True, 16 + len(THINK_END)), (False, None)):
        lm = EngineLM(engine, chat_template_kwargs={"enable_thinking": enabled}, think_end=THINK_END)
        prompt = lm.apply_chat_template(turns)
        assert prompt.endswith("<think>" if enabled else "<think></think>")
        assert lm.generate_until([_instance(prompt, 64)]) == ["The number is 17.\n#### 17"]
        assert lm.thinking == {("echo", 0): [think]}


def test_think_end_and_the_kwargs_are_checked_before_any_engine(tmp_path: Path) -> None:
    for task_keys, message in [
        ('apply_chat_template = true\nchat_template_kwargs = { enable_thinking = true }\n',
         r"tasks\[0\]\.think_end: missing: chat_template_kwargs\.enable_thinking = true"),
        ('chat_template_kwargs = { enable_thinking = false }\n',
         r"tasks\[0\]\.chat_template_kwargs: has no effect unless apply_chat_template = true"),
        ('apply_chat_template = true\nchat_template_kwargs = "enable_thinking"\n',
         r"tasks\[0\]\.chat_template_kwargs: expected a table of template arguments"),
        ('think_end = ""\n', r"tasks\[0\]\.think_end: expected a non-empty string"),
    ]:
        directory = tmp_path / str(len(list(tmp_path.iterdir())))
        directory.mkdir()
        path = write_gate(directory, lambda text, keys=task_keys: text.replace("[tasks.limits]\n",
                                                                               keys + "[tasks.limits]\n", 1))
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_think_end_on_a_task_that_generates_nothing_is_refused_before_any_engine() -> None:
    from pytest_fp8gate.run.lm_tasks import task_problem

    spec = TaskSpec("choice", "fp8gate_tiny_arith_choice", "acc", include_path=Path(__file__).parent / "data" / "tasks",
                    think_end=THINK_END)
    manager = task_manager([spec])
    assert task_problem([spec], manager) == (
        "tasks 'choice': think_end = '</think>', but fp8gate_tiny_arith_choice is a multiple_choice task: it "
        "generates nothing, so there is no thinking to cut; remove think_end")
    assert task_problem([dataclasses.replace(spec, think_end=None)], manager) is None


# A chat template in the manner of DeepSeek-R1's and Qwen3's: the prompt opens a thinking block, or holds an
# empty one when enable_thinking is false. The served engine renders it with its local tokenizer.
SERVED_TEMPLATE = ("{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}"
                   "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% else %}<think>"
                   "{% endif %}{% endif %}")


@pytest.mark.parametrize(("enabled", "budget"), [(True, 128), (False, 128), (True, 24)])
def test_a_served_reasoning_model_end_to_end(tmp_path: Path, enabled: bool, budget: int) -> None:
    # lm-eval's echo task through run_task and the served engine over HTTP: the template rendered here with
    # the task's kwargs, the ids sent, the fake endpoint thinking after "<think>", the answer cut after "</think>".
    from pytest_fp8gate.engines.vllm_served import VllmServedEngine

    write_gate(tmp_path)
    task = TaskSpec("echo", "fp8gate_fake_echo", "exact_match", limit=6, filter="strict-match",
                    include_path=tmp_path / "tasks", apply_chat_template=True, max_gen_toks=budget,
                    chat_template_kwargs={"enable_thinking": enabled}, think_end=THINK_END)
    knobs = Knobs(think=30)
    with FakeEndpoint(knobs) as url:
        spec = ModelSpec("bf16", embedded_assets().model.as_posix(), None, {},
                         served=ServedSpec("served-bf16", endpoint=url))
        engine = VllmServedEngine(spec, max_logprobs=5)
        engine.tokenizer.chat_template = SERVED_TEMPLATE
        try:
            samples = run_task(engine, task, tmp_path, task_manager([task]), "run", ALL_AT_ONCE)
        finally:
            engine.shutdown()
    rows = _rows(samples)
    # The questions' prompts (the others are the start's probe of the endpoint).
    sent = [text for text in map(engine.tokenizer.decode, knobs.prompts) if "Which number" in text]
    opened = "<think>" if enabled else "<think></think>"
    assert len(rows) == len(sent) == 6 and all(text.endswith(opened) for text in sent)
    scores = [row["exact_match"] for row in rows]
    if budget == 24:  # cut inside the thinking: every answer ends by length, with no marker and no answer
        assert {row[FINISH_REASON] for row in rows} == {"length"} and {row[THINKING_CHARS] for row in rows} == {None}
        assert sum(scores) == 0
        return
    assert {row[FINISH_REASON] for row in rows} == {"stop"} and sum(scores) == 6
    assert {row[THINKING_CHARS] for row in rows} == ({30 + len(THINK_END)} if enabled else {None})
    assert all(THINKING.split()[0] not in row["resps"][0][0] for row in rows)


def test_the_reasoning_keys_enter_the_task_fingerprint_only_when_set() -> None:
    plain = TaskSpec(name="t", task="t", metric="exact_match")
    assert "think_end" not in task_fingerprint(plain) and "chat_template_kwargs" not in task_fingerprint(plain)
    thinking = dataclasses.replace(plain, apply_chat_template=True, chat_template_kwargs={"enable_thinking": True},
                       think_end="</think>")
    assert task_fingerprint(thinking)["think_end"] == "</think>"
    assert task_fingerprint(thinking)["chat_template_kwargs"] == {"enable_thinking": True}
