"""The protocol kept with every accuracy: each task pass writes the protocol it ran under beside its samples
(kept in the baseline cache), and an expected_accuracy measured under another protocol is refused with one
line naming the key and both values, at load where the file alone decides it, else when the baseline is
judged; a matching one passes as before. Over the fake engine and the echo task (lm-eval runs for real)."""

from __future__ import annotations

import json

import pytest

from fakes import MODELS, fake_engine_class, write_gate
from pytest_fp8gate.core import protocol
from test_selection import UseEngine

ECHO_STOPS = ["Question:", "\n\n"]  # the echo task's generation_kwargs.until (fakes.TASK_YAML)


def gate_with(pytester: pytest.Pytester, limits: str, task: str = "") -> None:
    """The fake gate, ``limits`` added to the echo task's limits and ``task`` to its table."""
    write_gate(pytester.path, lambda text: text.replace("flip_alpha = 0.5\n", f"flip_alpha = 0.5\n{limits}\n")
               .replace('filter = "strict-match"\n', f'filter = "strict-match"\n{task}\n'))


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    return pytester.runpytest("thresholds.toml", "-k", "accuracy_within_se and good", *args,
                              plugins=[UseEngine(fake_engine_class(MODELS))])


def test_a_task_pass_keeps_its_protocol_beside_its_samples_and_in_the_cache(pytester: pytest.Pytester, fake_gpus):
    fake_gpus()
    write_gate(pytester.path)
    run(pytester, "--fp8gate-artifacts", "out", "--fp8gate-baseline-cache", "cache").assert_outcomes(passed=1)
    kept = json.loads((pytester.path / "out" / "bf16" / "main" / "protocol_echo.json").read_text())
    assert kept == {"prompt": "completions", "fewshot_as_multiturn": False, "add_bos_token": True,
                    "filter": "strict-match", "think_end": None, "chat_template_sha256": None, "num_fewshot": 0,
                    "until": ECHO_STOPS}
    assert set(kept) == set(protocol.KEYS)
    (entry,) = [p for p in (pytester.path / "cache").iterdir() if p.is_dir() and p.name.startswith("bf16-")]
    assert json.loads((entry / "main" / "protocol_echo.json").read_text()) == kept


MATCHING = f'expected_accuracy = 0.8\nexpected_protocol = {{ prompt = "completions", num_fewshot = 0, until = ' \
           f'{json.dumps(ECHO_STOPS)}, filter = "strict-match", add_bos_token = true }}'


def test_an_expected_accuracy_under_the_runs_protocol_passes_as_before(pytester: pytest.Pytester, fake_gpus):
    fake_gpus()
    gate_with(pytester, MATCHING)
    run(pytester, "--fp8gate-baseline-cache", "cache").assert_outcomes(passed=1)
    run(pytester, "--fp8gate-baseline-cache", "cache").assert_outcomes(passed=1)  # restored with its protocol


def test_stop_strings_only_the_run_knows_are_refused_when_the_baseline_is_judged(pytester: pytest.Pytester,
                                                                                fake_gpus):
    fake_gpus()
    gate_with(pytester, MATCHING.replace(json.dumps(ECHO_STOPS), '["Question:"]'))
    result = run(pytester)
    result.assert_outcomes(failed=1)
    assert ("tasks 'echo' limits.expected_protocol.until: expected_accuracy was measured under until = "
            '["Question:"], baseline bf16 ran echo under until = ["Question:", "\\n\\n"]') in result.stdout.lines


@pytest.mark.parametrize("protocol_table, key, values", [
    ('{ prompt = "chat_template" }', "prompt", 'prompt = "chat_template", this task runs under prompt = "completions"'),
    ("{ num_fewshot = 5 }", "num_fewshot", "num_fewshot = 5, this task runs under num_fewshot = 0"),
    ("{ add_bos_token = false }", "add_bos_token",
     "add_bos_token = false, this task runs under add_bos_token = true"),
])
def test_a_protocol_the_file_contradicts_is_refused_before_any_engine(pytester: pytest.Pytester, protocol_table: str,
                                                                    key: str, values: str):
    gate_with(pytester, f"expected_accuracy = 0.8\nexpected_protocol = {protocol_table}", task="num_fewshot = 0")
    engine = fake_engine_class(MODELS)
    result = pytester.runpytest("thresholds.toml", plugins=[UseEngine(engine)])
    assert result.ret == pytest.ExitCode.USAGE_ERROR and not engine.calls
    result.stderr.fnmatch_lines([f"ERROR: thresholds.toml: tasks*limits.expected_protocol.{key}: "
                                 f"expected_accuracy was measured under {values}"])


@pytest.mark.parametrize("limits, message", [
    ("expected_protocol = { prompt = 'completions' }", "has no effect unless limits.expected_accuracy is set"),
    ("expected_accuracy = 0.8\nexpected_protocol = { promt = 'completions' }", "promt: unknown protocol key*prompt*"),
    ("expected_accuracy = 0.8\nexpected_protocol = { prompt = 'chat' }",
     "prompt: expected 'completions' or 'chat_template', got string 'chat'"),
])
def test_a_malformed_expected_protocol_is_a_usage_error(pytester: pytest.Pytester, limits: str, message: str):
    gate_with(pytester, limits)
    result = pytester.runpytest("thresholds.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: thresholds.toml: tasks*expected_protocol*{message}"])
