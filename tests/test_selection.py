"""The gate run by pytest over the fake engine: what each engine measures follows the rule tests
that remain after -k/-m deselection, and a failing rule prints its explanation."""

from __future__ import annotations

import pytest

from fakes import MODELS, FakeEngine, fake_engine_class, write_gate


class UseEngine:
    """A plugin that stands ``engine_class`` in for vLLM's engine on every model, through the gate's hook."""

    def __init__(self, engine_class: type[FakeEngine]) -> None:
        self.engine_class = engine_class

    def pytest_fp8gate_engine_class(self) -> type[FakeEngine]:
        return self.engine_class


@pytest.fixture
def gate(pytester: pytest.Pytester, fake_gpus) -> pytest.Pytester:
    fake_gpus()
    write_gate(pytester.path)
    return pytester


def measured(engine: type[FakeEngine]) -> list[tuple[str, str]]:
    return [(call[0], call[1]) for call in engine.calls
            if call[0] in ("start", "prompt_logprobs", "generate_greedy", "continuation_logprobs", "latency")]


# The baseline's main and batch-order passes run in one engine, its fp16 pass in another.
SELECTIONS = {
    "kl only": (["-k", "kl_within"], {"passed": 1, "failed": 1},
                [("start", "bf16"), ("prompt_logprobs", "bf16"), ("prompt_logprobs", "bf16"),
                 ("start", "bf16"), ("prompt_logprobs", "bf16"),
                 ("start", "good"), ("prompt_logprobs", "good"), ("start", "bad"), ("prompt_logprobs", "bad")]),
    "accuracy of one candidate": (["-k", "accuracy and good"], {"passed": 2},  # the article's rule and the paired
                                  [("start", "bf16"), ("generate_greedy", "bf16"), ("generate_greedy", "bf16"),
                                   ("start", "bf16"), ("generate_greedy", "bf16"),
                                   ("start", "good"), ("generate_greedy", "good")]),
    "speed by marker expression": (["-k", "speed", "-m", "fp8gate"], {"passed": 1, "failed": 1},
                                   [("start", "bf16"), ("latency", "bf16"),  # no noise engine: no floor needed
                                    ("start", "good"), ("latency", "good"), ("start", "bad"), ("latency", "bad")]),
}


@pytest.mark.parametrize("args, outcomes, expected", SELECTIONS.values(), ids=SELECTIONS.keys())
def test_a_deselected_rule_is_never_measured(gate: pytest.Pytester, args: list[str], outcomes: dict,
                                            expected: list[tuple[str, str]]):
    engine = fake_engine_class(MODELS)
    result = gate.runpytest("thresholds.toml", *args, plugins=[UseEngine(engine)])
    result.assert_outcomes(**outcomes)
    assert measured(engine) == expected


def test_the_whole_gate_passes_the_good_candidate_and_explains_the_bad_ones_failures(
        pytester: pytest.Pytester, fake_gpus):
    fake_gpus()
    write_gate(pytester.path, task=False)  # the task rules' texts: test_verdicts.py (each lm-eval run costs a second)
    engine = fake_engine_class(MODELS)
    result = pytester.runpytest("thresholds.toml", "-q", "--show-capture=no", plugins=[UseEngine(engine)])
    result.assert_outcomes(passed=5, failed=5)
    result.stdout.fnmatch_lines([
        "*_ test_kl_within_limit[[]bad[]] _*",
        "mean_kl FAILED for candidate bad",
        "  reference   *  0.001355",
        "*fp8gate summary*",
    ])
    failed = [line.split(" ")[1] for line in result.stdout.lines if line.startswith("FAILED thresholds.toml::")]
    assert sorted(failed) == [f"thresholds.toml::{name}[bad]" for name in (
        "test_decode_speed_near_ceiling", "test_kl_within_limit", "test_ppl_ratio_within_limit",
        "test_rms_dp_within_limit", "test_same_top_near_baseline")]
    assert "Traceback" not in result.stdout.str()
    # Each engine started once for all ten rules.
    assert [call[1:] for call in engine.calls if call[0] == "start"] == [
        ("bf16", None), ("bf16", "float16"), ("good", None), ("bad", None)]
