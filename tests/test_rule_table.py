"""One name per rule: the registry, the suite's test ids, the verdicts, the JSON and the summary agree."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

import pytest

from fakes import TASK, fake_baseline, logprob_run, make_measurements, sample_rows, write_pass, write_recorded_gate
from pytest_fp8gate.config import schema
from pytest_fp8gate.config.spec import DecodeLimits, LoadSpec, ProbabilityLimits, SpeculativeSpec, SpeedSpec, TaskLimits
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.logprobs import LogprobComparison
from pytest_fp8gate.face import suite
from pytest_fp8gate.face.report_hooks import summary_lines
from pytest_fp8gate.judge import tasks
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.kinds import KINDS
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.record import ModelResult


def test_the_suite_has_one_test_per_rule() -> None:
    tests = {name for name, fn in inspect.getmembers(suite, inspect.isfunction) if name.startswith("test_")}
    assert tests == set(rules.BY_TEST)
    assert len(rules.BY_NAME) == len(rules.RULES) == len(rules.BY_TEST)


def test_each_row_names_its_verdict_and_its_limit() -> None:
    comparison_fields = {f.name for f in dataclasses.fields(LogprobComparison)}
    tables = {"probability": ProbabilityLimits, "bucket": ProbabilityLimits, "task": TaskLimits, "speed": SpeedSpec,
              "decode": DecodeLimits, "load": LoadSpec, "speculative": SpeculativeSpec}
    for rule in rules.RULES:
        assert rule.limit_key in {f.name for f in dataclasses.fields(tables[rule.kind])}, rule
        if rule.kind in ("probability", "bucket") or rule.bound is not None:
            # A decode rule with a bound: the probability check's figure of its name, on generated positions.
            assert rule.kind in ("probability", "decode", "bucket"), rule
            metric = rule.name.removeprefix(rules.DECODE_PREFIX).removeprefix(rules.BUCKET_PREFIX)
            assert metric in comparison_fields and rule.bound in (rules.at_least, rules.at_most,
                                                                  rules.ratio_at_most), rule
            assert rule.se_field in comparison_fields, rule
        else:  # judged by its kind's verdict function (judge/kinds.py); a task rule by the one tasks.py names
            assert rule.kind in ("task", "speed", "load", "speculative", "decode"), rule
    # Every task verdict is a task rule's, and every kind but the task one has one verdict for its rules.
    assert set(tasks.VERDICTS) == {rule.name for rule in rules.BY_KIND[rules.Kind.TASK]}
    assert {kind for kind, work in KINDS.items() if work.verdict is tasks.verdict} == {rules.Kind.TASK}
    assert schema.PROBABILITY_METRIC_LIMITS == tuple(
        rule.limit_key for rule in rules.RULES if rule.kind == "probability")


ALL_RULES = """
[probabilities.limits]
per_bucket = true
max_mean_kl = 0.01
min_same_top = 0.9
max_rms_dp = 0.05
max_ppl_ratio = 1.01
max_kl_p99 = 0.05
[decode]
prompts = 2
prompt_tokens = 100
new_tokens = 50
[decode.limits]
min_same_top = 0.9
max_rms_dp = 0.05
max_mean_kl = 0.01
max_gap_kl = 0.01
[speed]
bandwidth_gbps = 100
"""
# The optional task rules' limits, in the task's table.
TASK_LIMITS = ("limit = 30\n[tasks.limits]\nmax_length_drift = 0.1\nmax_invalid_increase = 0.02\nmin_recovery = 0.5\n"
               "max_truncation_increase = 0.02\n")


def _gate_file(tmp_path: Path) -> Path:
    path = write_recorded_gate(tmp_path / "gate")
    text = path.read_text().replace("[probabilities.limits]\nmax_mean_kl = 0.01\nmin_same_top = 0.9\n", "")
    # Two position buckets of about 200 positions each, both judged by the bucket rules.
    text = text.replace("top_k = 3\n", "top_k = 3\nbucket_edges = [100]\nmin_bucket_positions = 100\n")
    path.write_text(text.replace("limit = 30\n", TASK_LIMITS) + ALL_RULES)
    return path


# The load and acceptance rules need served models, which this recorded gate is not: tests/test_load.py and
# tests/test_spec_decode.py collect and judge them (JSON "rule" and summary line included) over fake endpoints.
IN_PROCESS_RULES = [rule for rule in rules.RULES if rule.kind not in ("load", "speculative")]


def test_every_rule_is_collected_under_its_test(pytester: pytest.Pytester, tmp_path: Path) -> None:
    path = _gate_file(tmp_path)
    result = pytester.runpytest("--fp8gate-config", str(path), str(path), "--collect-only", "-q", "-p", "no:randomly")
    ids = [line for line in result.stdout.lines if "::" in line]
    assert {node.split("::")[1].split("[")[0] for node in ids} == {rule.test for rule in IN_PROCESS_RULES}
    # One candidate, one task: each rule's id carries exactly its cases.
    assert sorted(node.split("::")[1] for node in ids) == sorted(
        f"{rule.test}[fp8-{TASK}]" if rule.kind == "task" else f"{rule.test}[fp8]" for rule in IN_PROCESS_RULES)


def test_each_verdict_the_json_and_the_summary_use_the_rule_s_name(tmp_path: Path) -> None:
    measurements = make_measurements(_gate_file(tmp_path), tmp_path / "artifacts")
    measurements._measure_baseline_engines = fake_baseline(measurements)
    cand = write_pass(tmp_path / "artifacts" / "fp8", "main", logprob_run(0, 0.05), sample_rows({3, 4, 9}))
    measurements._candidates["fp8"] = ModelResult(measurements.config.candidates[0], cand, 1.0, None, 8)
    gate = Gate(measurements.config, measurements)
    # speed: tests/test_speed_verdict.py; decode: tests/test_generation_rules.py (they need an engine's continuations)
    judged = [rule for rule in IN_PROCESS_RULES if rule.kind not in ("speed", "decode")]
    verdicts = [gate.evaluate(Case(rule.name, "fp8", TASK if rule.kind == "task" else None)) for rule in judged]
    assert [v.outcome.rule for v in verdicts] == [v.case.rule for v in verdicts] == [rule.name for rule in judged]
    assert [v.as_dict()["rule"] for v in verdicts] == [v.case.rule for v in verdicts]
    assert [line.split()[0] for line in summary_lines(verdicts)[1:]] == [v.case.rule for v in verdicts]
    # Each explanation ends with where to act: the limit's key, and the command that recomputes the number.
    gate_file, artifacts = measurements.config.path, tmp_path / "artifacts"
    kl = next(v for v in verdicts if v.case.rule == "mean_kl")
    assert kl.explain().splitlines()[-2:] == [
        f"  limit: {gate_file} probabilities.limits.max_mean_kl = 0.01",
        f"  recompute: fp8gate compare-logprobs {artifacts / 'bf16/main/logprobs.npz'} "
        f"{artifacts / 'fp8/main/logprobs.npz'}"]
    accuracy = next(v for v in verdicts if v.case.rule == "accuracy")
    assert accuracy.explain().splitlines()[-2:] == [
        f"  limit: {gate_file} tasks[0].limits.accuracy_se = 1",
        f"  recompute: fp8gate flips {artifacts / 'bf16/main/samples_tiny.jsonl'} "
        f"{artifacts / 'fp8/main/samples_tiny.jsonl'} --filter strict-match --metric exact_match"]
    speed = rules.decode_speed(rules.DecodeSpeed(90.0, 100.0), rules.DecodeSpeed(60.0, 70.0))
    assert speed.rule == rules.SPEED == rules.BY_TEST["test_decode_speed_near_ceiling"].name
