"""--fp8gate-candidate judges only the candidates named, over the fake engine: the others are never
started, the baseline is measured as for the whole file, and a name the file lacks is a usage error."""

from __future__ import annotations

import pytest

from fakes import MODELS, fake_engine_class, write_gate
from test_selection import UseEngine, measured


@pytest.fixture
def gate(pytester: pytest.Pytester, fake_gpus) -> pytest.Pytester:
    fake_gpus()
    write_gate(pytester.path, task=False)  # the probability and speed rules: 5 per candidate
    return pytester


def started(engine) -> list[str]:
    return [name for call, name in measured(engine) if call == "start"]


@pytest.mark.parametrize("args", [["--fp8gate-candidate", "good"], ["--fp8gate-candidate", " good, "]])
def test_only_the_named_candidate_is_started_and_judged(gate: pytest.Pytester, args: list[str]):
    engine = fake_engine_class(MODELS)
    result = gate.runpytest("thresholds.toml", "-v", *args, plugins=[UseEngine(engine)])
    result.assert_outcomes(passed=5)  # "bad" would fail all 5 of its rules
    assert started(engine) == ["bf16", "bf16", "good"]  # the baseline, its fp16 noise engine, the candidate
    result.stdout.fnmatch_lines(["fp8gate: thresholds.toml: bf16 vs good (selected by --fp8gate-candidate)"])
    result.stdout.no_fnmatch_line("*[[]bad[]]*")


def test_repeated_and_comma_listed_names_select_each_once(gate: pytest.Pytester):
    engine = fake_engine_class(MODELS)
    result = gate.runpytest("thresholds.toml", "--fp8gate-candidate", "bad,good", "--fp8gate-candidate", "good",
                            plugins=[UseEngine(engine)])
    result.assert_outcomes(passed=5, failed=5)
    assert started(engine) == ["bf16", "bf16", "good", "bad"]  # in the file's order


def test_a_name_the_file_lacks_is_a_usage_error_naming_the_file_and_its_candidates(gate: pytest.Pytester):
    result = gate.runpytest("thresholds.toml", "--fp8gate-candidate", "good,fp8-dynamic",
                            plugins=[UseEngine(fake_engine_class(MODELS))])
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fp8gate-candidate fp8-dynamic: not a candidate of thresholds.toml "
                                 "(its candidates: good, bad)"])


def test_baseline_only_measures_the_baseline_and_no_candidate_is_judged(gate: pytest.Pytester):
    engine = fake_engine_class(MODELS)
    result = gate.runpytest("thresholds.toml", "-rs", "--fp8gate-baseline-only", "--fp8gate-baseline-cache", "cache",
                            plugins=[UseEngine(engine)])
    result.assert_outcomes(skipped=10)
    assert started(engine) == ["bf16", "bf16"]
    result.stdout.fnmatch_lines(["*--fp8gate-baseline-only: the baseline is measured in this session and stored "
                                 "in the baseline cache*candidate good is judged by a run without that option*"])


def test_baseline_only_without_a_cache_is_a_usage_error(gate: pytest.Pytester):
    result = gate.runpytest("thresholds.toml", "--fp8gate-baseline-only")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: --fp8gate-baseline-only needs a cache to keep the baseline in: "
                                 "--fp8gate-baseline-cache DIR*"])


def test_the_ci_matrix_walkthrough_measures_the_baseline_once_for_every_candidate_job(gate: pytest.Pytester):
    """docs/usage.md's GitHub Actions recipe in sequence on one cache directory (the fake engine stands in for
    vLLM: the sequencing, not the figures, is under test): the baseline job, then one job per candidate."""
    cache = ["--fp8gate-baseline-cache", "cache"]
    jobs = {"baseline": ["--fp8gate-baseline-only"], "good": ["--fp8gate-candidate", "good"],
            "bad": ["--fp8gate-candidate", "bad"]}
    outcomes = {"baseline": {"skipped": 10}, "good": {"passed": 5}, "bad": {"failed": 5}}
    for job, args in jobs.items():
        engine = fake_engine_class(MODELS)
        result = gate.runpytest("thresholds.toml", *cache, *args, plugins=[UseEngine(engine)])
        result.assert_outcomes(**outcomes[job])
        assert started(engine) == (["bf16", "bf16"] if job == "baseline" else [job]), job
        if job != "baseline":
            result.stdout.fnmatch_lines(["fp8gate: baseline bf16 from the cache: *; no baseline engine started"])
