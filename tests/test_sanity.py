"""Sanity checks before judging: impossible log-probs, a baseline at chance, artifacts of two runs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fakes import build_measurements, thresholds_text
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core.dumps import SAMPLES_RUN_ID, write_lm_eval_samples, write_logprob_dump
from pytest_fp8gate.core.logprobs import LogprobRun, check_vocabulary
from pytest_fp8gate.errors import ComparisonError
from pytest_fp8gate.judge.gate import Gate, GateError
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import MeasurementError, Measurements
from pytest_fp8gate.run.record import BaselineRecord, ModelResult, Needs, PassResult
from pytest_fp8gate.tools import cli


def _run(**overrides: np.ndarray) -> LogprobRun:
    arrays = {"real_logprob": np.log([0.5, 0.25]), "top_ids": np.array([[3, 1], [2, 0]]),
              "top_logprobs": np.log([[0.5, 0.3], [0.6, 0.25]])}
    return LogprobRun(**{**arrays, **overrides})


IMPOSSIBLE_RUNS = {
    "positive real": ({"real_logprob": np.array([-0.1, 0.7])},
                      "real_logprob holds 0.7 at position 1; a log-probability is at most 0"),
    "positive top": ({"top_logprobs": np.array([[0.2, -1.0], [-0.5, -1.0]])},
                     "top_logprobs holds 0.2 at position 0; a log-probability is at most 0"),
    "positive on base ids": ({"logprobs_on_base_ids": np.array([[np.nan, -1.0], [3.0, -1.0]])},
                             "logprobs_on_base_ids holds 3 at position 1; a log-probability is at most 0"),
    "negative top id": ({"top_ids": np.array([[3, 1], [-3, 0]])},
                        "top_ids holds the negative token id -3 at position 1"),
    "negative token id": ({"token_ids": np.array([5, -3])}, "token_ids holds the negative token id -3 at position 1"),
    "unnormalised full": ({"full_logprobs": np.zeros((2, 4))},
                          "full_logprobs at position 0 sums to probability 4, not 1; "
                          "not a distribution over the vocabulary"),
    "NaN in full": ({"full_logprobs": np.log(np.array([[0.25] * 4, [0.25, 0.25, 0.5, np.nan]]))},
                    "full_logprobs holds NaN at position 1; a log-probability is due at every position and rank"),
    "NaN on the real token": ({"real_logprob": np.array([-0.1, np.nan])},
                              "real_logprob holds NaN at position 1; a log-probability is due at every position "
                              "and rank"),
    "NaN among the runner-ups": ({"top_logprobs": np.array([[-0.5, -1.0], [-0.5, np.nan]])},
                                 "top_logprobs holds NaN at position 1; a log-probability is due at every "
                                 "position and rank"),
    "+inf among the runner-ups": ({"top_logprobs": np.array([[-0.5, -1.0], [-0.5, np.inf]])},
                                  "top_logprobs holds inf at position 1; a log-probability is at most 0"),
    "+inf on base ids": ({"logprobs_on_base_ids": np.array([[np.nan, -1.0], [np.inf, -1.0]])},
                         "logprobs_on_base_ids holds inf at position 1; a log-probability is at most 0"),
}


@pytest.mark.parametrize("overrides, message", IMPOSSIBLE_RUNS.values(), ids=IMPOSSIBLE_RUNS.keys())
def test_impossible_logprobs_are_refused(overrides: dict[str, np.ndarray], message: str) -> None:
    with pytest.raises(ComparisonError) as info:
        _run(**overrides)
    assert str(info.value) == message


def test_ids_beyond_the_vocabulary_are_refused() -> None:
    run = _run(top_ids=np.array([[3, 1], [264, 0]]))
    check_vocabulary(run, 265)
    with pytest.raises(ComparisonError) as info:
        check_vocabulary(run, 259)
    assert str(info.value) == "top_ids holds the token id 264 at position 1, beyond the vocabulary of 259 ids"


def test_probability_zero_and_ids_only_runs_are_accepted() -> None:
    # -inf is probability 0 (a runner-up the model rules out); a dump of the top ids alone has no log-probs.
    assert _run(top_logprobs=np.array([[-0.5, -np.inf], [-0.6, -1.0]])).positions == 2
    assert _run(top_logprobs=np.full((2, 2), np.nan)).positions == 2


def test_rounding_above_zero_and_normalised_distributions_are_accepted() -> None:
    full = np.log(np.array([[0.5, 0.25, 0.125, 0.125], [0.7, 0.1, 0.1, 0.1]], dtype=np.float32))
    run = _run(real_logprob=np.array([3.6e-7, -1.0]), full_logprobs=full)
    assert run.positions == 2


def test_the_cli_refuses_an_impossible_dump_with_one_line(tmp_path: Path, capsys) -> None:
    good = tmp_path / "base.json"
    bad = tmp_path / "cand.json"
    good.write_text(json.dumps([{"real": -0.5, "top": 1}, {"real": -1.0, "top": 2}]))
    bad.write_text(json.dumps([{"real": -0.5, "top": 1}, {"real": 1.5, "top": -3}]))
    assert cli.main(["compare-logprobs", str(good), str(bad)]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "real_logprob holds 1.5 at position 1" in err and "Traceback" not in err


# ---- artifacts of two runs -------------------------------------------------------


def _dump(path: Path, run_id: str | None) -> Path:
    write_logprob_dump(path, _run(), {} if run_id is None else {"run_id": run_id})
    return path


def test_compare_logprobs_refuses_dumps_of_two_runs(tmp_path: Path, capsys) -> None:
    base, cand = _dump(tmp_path / "base.npz", "run-a"), _dump(tmp_path / "cand.npz", "run-b")
    assert cli.main(["compare-logprobs", str(base), str(cand)]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == (f"fp8gate: error: {cand}: written by gate run run-b, but baseline {base} "
                                       "by run run-a; artifacts of two different runs are not compared\n")


@pytest.mark.parametrize("ids", [("run-a", "run-a"), (None, "run-a")], ids=["same run", "one without an id"])
def test_compare_logprobs_pairs_dumps_of_one_run(tmp_path: Path, capsys, ids) -> None:
    base, cand = _dump(tmp_path / "base.npz", ids[0]), _dump(tmp_path / "cand.npz", ids[1])
    assert cli.main(["compare-logprobs", str(base), str(cand)]) == 0


def _samples(path: Path, *run_ids: str | None) -> Path:
    rows = [{"doc_id": i, "filter": "strict-match", "exact_match": 1, "prompt_hash": f"h{i}",
             "filtered_resps": ["1"], "target": "1", **({} if run_id is None else {SAMPLES_RUN_ID: run_id})}
            for i, run_id in enumerate(run_ids)]
    write_lm_eval_samples(path, rows)
    return path


def test_flips_refuses_samples_of_two_runs(tmp_path: Path, capsys) -> None:
    base = _samples(tmp_path / "base.jsonl", "run-a", "run-a")
    cand = _samples(tmp_path / "cand.jsonl", "run-b", "run-b")
    assert cli.main(["flips", str(base), str(cand)]) == cli.EXIT_ERROR
    assert "artifacts of two different runs are not compared" in capsys.readouterr().err


def test_flips_refuses_a_samples_file_mixing_two_runs(tmp_path: Path, capsys) -> None:
    base = _samples(tmp_path / "base.jsonl", "run-a", "run-a")
    cand = _samples(tmp_path / "cand.jsonl", "run-a", "run-b")
    assert cli.main(["flips", str(base), str(cand)]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == (f"fp8gate: error: {cand}: lm-eval --log_samples JSONL rows of one gate run; "
                                       "rows of runs run-a, run-b are mixed\n")


def test_flips_pairs_samples_of_one_run(tmp_path: Path) -> None:
    base = _samples(tmp_path / "base.jsonl", "run-a", "run-a")
    cand = _samples(tmp_path / "cand.jsonl", "run-a", "run-a")
    assert cli.main(["flips", str(base), str(cand), "--metric", "exact_match"]) == 0


# ---- a baseline at chance ----------------------------------------------------------

TASK_GATE = thresholds_text('[[tasks]]\nname = "arith"\ntask = "arith"\nfilter = "strict-match"\n'
                            'metric = "exact_match"\n{limits}')


class RecordedMeasurements:
    """Measurements an earlier run left on disk: the gate judges them without an engine."""

    def __init__(self, config, samples: dict[str, Path], vocab: dict[str, int]) -> None:
        self.results = {spec.name: ModelResult(spec, PassResult("main", samples={"arith": samples[spec.name]}),
                                               0.0, None, vocab[spec.name])
                        for spec in (config.baseline, *config.candidates)}
        self.config = config

    def record(self) -> BaselineRecord:
        return BaselineRecord(self.results[self.config.baseline.name], [], [])

    def candidate(self, name: str) -> ModelResult:
        return self.results[name]


def _graded(path: Path, correct: list[int]) -> Path:
    write_lm_eval_samples(path, [{"doc_id": i, "filter": "strict-match", "exact_match": c, "prompt_hash": f"h{i}",
                                  "filtered_resps": ["x"], "target": "y"} for i, c in enumerate(correct)])
    return path


def _gate(tmp_path: Path, base_correct: list[int], limits: str = "") -> Gate:
    (tmp_path / "thresholds.toml").write_text(TASK_GATE.format(limits=limits))
    config = load_config(tmp_path / "thresholds.toml")
    samples = {"bf16": _graded(tmp_path / "base.jsonl", base_correct),
               "fp8": _graded(tmp_path / "cand.jsonl", [0] * len(base_correct))}
    return Gate(config, RecordedMeasurements(config, samples, {"bf16": 32, "fp8": 32}))


@pytest.mark.parametrize("rule", ["accuracy", "flips"])
def test_a_baseline_scoring_zero_fails_the_task_rules(tmp_path: Path, rule: str) -> None:
    gate = _gate(tmp_path, [0] * 40)
    with pytest.raises(GateError) as info:
        gate.evaluate(Case(rule, "fp8", "arith"))
    assert str(info.value) == (
        "baseline bf16 scores 0.0000 on arith (40 questions, filter 'strict-match', metric 'exact_match'), at or "
        "below 0.05 (tasks.limits.min_baseline_accuracy): the task cannot tell a broken build from a good one; "
        "check the task, filter, metric and few-shot setup")


def test_the_chance_floor_is_configurable(tmp_path: Path) -> None:
    below = _gate(tmp_path, [1] * 4 + [0] * 36, "[tasks.limits]\nmin_baseline_accuracy = 0.25")
    with pytest.raises(GateError, match="scores 0.1000 on arith .* at or below 0.25"):
        below.evaluate(Case("accuracy", "fp8", "arith"))
    # Above the floor the rule judges the candidate: all of its answers are wrong, so it fails.
    above = _gate(tmp_path, [1] * 4 + [0] * 36, "[tasks.limits]\nmin_baseline_accuracy = 0.05")
    assert not above.evaluate(Case("accuracy", "fp8", "arith")).passed


def test_a_filter_the_samples_lack_names_the_task_key(tmp_path: Path) -> None:
    recorded = _gate(tmp_path, [1] * 40)
    wrong = replace(recorded.config.tasks[0], filter="flexible-extract")
    config = replace(recorded.config, tasks=(wrong,))
    gate = Gate(config, recorded.comparisons.records)
    with pytest.raises(GateError) as info:
        gate.evaluate(Case("flips", "fp8", "arith"))
    assert str(info.value) == (
        f"{gate.config.path}: tasks[0] (filter 'flexible-extract', metric 'exact_match'): lm-eval's samples do not "
        "have it: lm-eval --log_samples JSONL rows with filter 'flexible-extract' (filters present: strict-match) "
        f"(in {tmp_path / 'base.jsonl'})")


# ---- failures inside an engine run, caught at the edge -------------------------------


def _measurements(tmp_path: Path, model: str = "org/base") -> Measurements:
    (tmp_path / "thresholds.toml").write_text(TASK_GATE.format(limits="").replace('"org/base"', f'"{model}"'))
    return build_measurements(load_config(tmp_path / "thresholds.toml"), tmp_path / "artifacts",
                             {"fp8": Needs(tasks=frozenset({"arith"}))})


def test_an_engine_side_failure_is_one_line_with_the_traceback_saved(tmp_path: Path) -> None:
    measurements = _measurements(tmp_path)

    def fails() -> None:
        raise RuntimeError("Engine core initialization failed.\nSee root cause above.")

    saved = tmp_path / "artifacts" / "bf16" / "error.txt"
    with pytest.raises(MeasurementError) as info:
        measurements._once("bf16", fails)
    assert str(info.value) == (f"measuring bf16 failed: RuntimeError: Engine core initialization failed. "
                               f"(traceback: {saved})")
    assert "Traceback" in saved.read_text() and "See root cause above." in saved.read_text()
    with pytest.raises(MeasurementError) as again:
        measurements._once("bf16", fails)
    assert str(again.value) == f"{info.value} (earlier in this session; not retried)"


def test_an_uncached_hub_model_offline_fails_before_any_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    measurements = _measurements(tmp_path, model="org/not-downloaded")
    with pytest.raises(MeasurementError) as info:
        measurements.baseline()
    assert str(info.value) == (
        f"measuring bf16: {tmp_path / 'thresholds.toml'}: baseline.model: 'org/not-downloaded' is not in the Hugging "
        "Face cache and HF_HUB_OFFLINE is set; download it first (hf download org/not-downloaded) "
        "or unset HF_HUB_OFFLINE")


@pytest.mark.parametrize("rule, key", [("ratio", "flips_ratio = 2"), ("binomial", "flip_alpha = 0.05")])
def test_the_flip_rule_named_in_the_limits_is_judged_and_explains_itself(tmp_path: Path, rule: str, key: str) -> None:
    # The candidate gets all 20 of the baseline's right answers wrong against a floor of 0 flips.
    gate = _gate(tmp_path, [1] * 20 + [0] * 20, f'[tasks.limits]\nflip_rule = "{rule}"')
    verdict = gate.evaluate(Case("flips", "fp8", "arith"))
    assert not verdict.passed and verdict.outcome.rule == "flips"
    # It ends with where to act: the limit's key, and the command that recomputes the flips from the samples.
    assert verdict.explain().splitlines()[-2:] == [
        f"  limit: {tmp_path / 'thresholds.toml'} tasks[0].limits.{key}",
        f"  recompute: fp8gate flips {tmp_path / 'base.jsonl'} {tmp_path / 'cand.jsonl'} "
        "--filter strict-match --metric exact_match"]
    text = verdict.explain()
    assert "candidate flips" in text and "margin in SE of the rates (addition)" in text
    assert "Resolution at 40 questions and a floor rate of 0" in text
    assert ("one-sided exact conditional binomial test (an addition)" in text) == (rule == "binomial")
