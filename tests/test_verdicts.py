"""Every rule's verdict and the explanation a failing test prints, measured through the fake engine
(lm-eval runs the echo task on it) on one gate that sets every rule of the rule table: the "good"
candidate passes each rule, and a candidate planted to fail it (FAILS_ON) fails it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fakes import DECODE, MODELS, FakeModel, fake_engine_class, fake_gate, write_gate
from pytest_fp8gate import hardware
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import GateConfig, LoadSpec, SpeculativeSpec
from pytest_fp8gate.core import rules
from pytest_fp8gate.face import cases, suite
from pytest_fp8gate.judge.verdict import Verdict

RULE_TESTS = sorted(name for name in vars(suite) if name.startswith("test_"))
# Besides "good" and "bad" (fakes.MODELS, with a speculator that accepts fewer drafts): a broken KV cache that
# only decoding reads, and answers rambling past the token budget (cut, no parsable answer, longer).
ALL_MODELS = {**MODELS, "bad": dataclasses.replace(MODELS["bad"], draft_acceptance=0.2),
              "kv": FakeModel(decode_noise=0.3, seed=1), "rambling": FakeModel(logit_noise=0.004, seed=4, ramble=200)}
FAILS_ON = {rule.name: "bad" for rule in rules.RULES} | {rules.DECODE_GAP: "kv"} | {
    name: "rambling" for name in (rules.LENGTH_DRIFT, rules.INVALID_RATE, rules.TRUNCATION)}
# Where each kind's limits are set in the thresholds file, and the command that recomputes a verdict's figure.
SETTINGS = {"probability": "probabilities.limits", "bucket": "probabilities.limits", "decode": "decode.limits",
            "task": "tasks[0].limits", "speed": "speed", "load": "load", "speculative": "speculative"}
RECOMPUTE = {rules.ACCURACY: "fp8gate flips ", rules.PAIRED_ACCURACY: "fp8gate flips ", rules.FLIPS: "fp8gate flips ",
             rules.RECOVERY: "fp8gate flips ", rules.SPEED: "fp8gate roofline "} | {
    rule.name: "fp8gate compare-logprobs " for rule in rules.RULES if rule.kind in ("probability", "bucket", "decode")}


def _every_limit(text: str) -> str:
    """write_gate's thresholds with every optional rule's limit set, and the planted candidates."""
    text = "run_alpha = 0\n" + text  # each rule at its own level: the shared budget is tested in test_run_budget.py
    text = text.replace("top_k = 5\n", "top_k = 5\nbucket_edges = [200]\nmin_bucket_positions = 100\n")
    text = text.replace("max_ppl_ratio = 1.000425\n",
                        "max_ppl_ratio = 1.000425\nmax_kl_p99 = 0.01\nper_bucket = true\n")
    text = text.replace("flip_alpha = 0.5\n", "flip_alpha = 0.5\nmax_length_drift = 0.1\nmax_invalid_increase = 0.02\n"
                                              "min_recovery = 0.9\nmax_truncation_increase = 0.02\n")
    text = text.replace('[[candidates]]\nname = "good"', DECODE + '[[candidates]]\nname = "good"', 1)
    return text + "".join(f'\n[[candidates]]\nname = "{name}"\nquantization = "fp8_per_channel"\n'
                          for name in ("kv", "rambling"))


def all_rules_config(directory: Path) -> GateConfig:
    """A gate that sets every rule of the rule table. The loader keeps [load] and [speculative] for served models;
    the fake engine reports load levels and a speculator's counters in-process, so they are set on the loaded file."""
    config = load_config(write_gate(directory, _every_limit))
    return dataclasses.replace(config, load=LoadSpec(concurrencies=(1, 4), requests=4, input_len=16, output_len=16,
                                                     min_throughput_fraction=0.6),
                               speculative=SpeculativeSpec(min_acceptance_ratio=0.9))


P_ROW = "p, one-sided normal, of missing the limit (addition)"


def probability_rows(metric: str) -> list[str]:
    return ["reference", "noise floor", "candidate", "noise floor SE (fails beyond 1 SE)", P_ROW,
            f"{metric} caught with 80% power (addition)", "threshold", "margin"]


# suite test -> the rows of its table, how its notes start and the limit it names
EXPLAINED = {
    "test_accuracy_within_se": (
        ["baseline accuracy", "standard error", "questions", "candidate accuracy",
         "drop caught with 80% power (addition)", "threshold", "margin"],
        ["SE = sqrt(p(1-p)/n) with p the baseline accuracy; k = 1, one-sided (a drop fails)",
         "McNemar exact p on the flips: ", "noise pass batch-order: accuracy ", "noise pass fp16: accuracy "],
        "tasks[0].limits.accuracy_se = 1"),
    "test_paired_accuracy": (
        ["questions", "right to wrong", "wrong to right", "accuracy drop", "paired SE, sqrt(D)/n",
         "p, one-sided exact McNemar", "test level alpha", "practical margin", "drop caught with 80% power (addition)",
         "threshold", "margin"],
        ["an addition beside the article's accuracy rule: fails when the drop ", "resolution at 40 questions and ",
         "noise pass batch-order: ", "noise pass fp16: "], "tasks[0].limits.accuracy_margin = 0.01"),
    "test_flips_within_noise_floor": (
        ["questions", "noise floor flips", "noise passes summed (addition)", "2 x noise floor", "minimum allowance",
         "candidate flips",
         "p, exact test of flips <= 2 x floor (addition)", "margin in SE of the rates (addition)",
         "flip rate caught with 80% power (addition)", "test level alpha", "threshold", "margin"],
        ["candidate flips: ",
         "judged by the one-sided exact conditional binomial test (an addition): fails when p < 0.5",
         "noise pass batch-order: ", "noise pass fp16: "], "tasks[0].limits.flip_alpha = 0.5"),
    "test_same_top_near_baseline": (
        probability_rows("same_top"), ["noise pass batch-order: same_top = ", "noise pass fp16: same_top = ",
                           "judged like accuracy: "],
        "probabilities.limits.min_same_top = 0.97674"),
    "test_rms_dp_within_limit": (
        probability_rows("rms_dp"),
        ["noise pass batch-order: rms_dp = ", "noise pass fp16: rms_dp = ", "judged like accuracy: "],
        "probabilities.limits.max_rms_dp = 0.01198"),
    "test_ppl_ratio_within_limit": (
        ["reference", "noise floor", "candidate", "SE of ln noise floor (fails beyond 1 SE)", "limit x exp(1 SE)",
         P_ROW, "ppl_ratio caught with 80% power (addition)", "threshold", "margin"],
        ["noise pass batch-order: ppl_ratio = ", "noise pass fp16: ppl_ratio = ", "judged like accuracy: "],
        "probabilities.limits.max_ppl_ratio = 1.00042"),
    "test_kl_within_limit": (
        probability_rows("mean_kl"), ["noise pass batch-order: mean_kl = ", "noise pass fp16: mean_kl = ",
                           "KL(base || candidate) is exact", "judged like accuracy: "],
        "probabilities.limits.max_mean_kl = 0.001355"),
    "test_decode_speed_near_ceiling": (
        ["baseline tok/s", "baseline ceiling tok/s", "baseline share of ceiling", "candidate tok/s",
         "candidate ceiling tok/s", "candidate share of ceiling", "measured speedup", "speedup the bytes allow",
         "overhead-bound below share", "threshold", "margin"],
        ["auto: 100 GB/s per GPU; bytes read per decoded token: candidate ", "the candidate is overhead-bound: ",
         "decode excludes prefill: median ", "KV-cache capacity: candidate 4096 tokens, baseline 4096 tokens"],
        "speed.min_ratio_overhead_bound = 0.5"),
}


@pytest.fixture(scope="module")
def directory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gate")


@pytest.fixture(scope="module")
def verdicts(directory: Path) -> dict[tuple[str, str], Verdict]:
    """(suite test, candidate) -> verdict, every rule of the rule table measured once on one gate."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "probe_cuda", lambda: hardware.CudaProbe((), "faked by the test"))
        config = all_rules_config(directory)
        engine_class = fake_engine_class(ALL_MODELS)
        params = {name: [param.values[0] for param in cases.cases_for(name, config, engine_class)]
                  for name in RULE_TESTS}
        needs = cases.needs_of([case for found in params.values() for case in found])
        gate = fake_gate(config, directory / "artifacts", needs, engine_class)
        return {(name, case.candidate): gate.evaluate(case) for name, found in params.items() for case in found}


def test_every_rule_of_the_table_is_judged_for_every_candidate(verdicts: dict[tuple[str, str], Verdict]):
    assert RULE_TESTS == sorted(rule.test for rule in rules.RULES) and set(EXPLAINED) <= set(RULE_TESTS)
    assert set(verdicts) == {(name, candidate) for name in RULE_TESTS for candidate in ALL_MODELS}


@pytest.mark.parametrize("test_name", RULE_TESTS)
@pytest.mark.parametrize("state", ["passed", "FAILED"])
def test_each_verdict_explains_itself_side_by_side(verdicts: dict[tuple[str, str], Verdict], directory: Path,
                                                   test_name: str, state: str):
    rule = rules.BY_TEST[test_name]
    candidate = "good" if state == "passed" else FAILS_ON[rule.name]
    verdict = verdicts[test_name, candidate]
    assert verdict.passed is (state == "passed"), verdict.explain()
    lines = verdict.explain().splitlines()
    on_task = f" on {verdict.case.task}" if verdict.case.task else ""
    assert lines[0] == f"{rule.name} {state} for candidate {candidate}{on_task}"
    # One aligned row per figure: label, then the value from the rule's outcome.
    rows = [label for label, _ in verdict.outcome.rows]
    width = max(map(len, rows))
    assert lines[1:1 + len(rows)] == [f"  {label:<{width}}  {value:.6g}" for label, value in verdict.outcome.rows]
    assert (dict(verdict.outcome.rows)["margin"] >= 0) is verdict.passed
    written = [line.removeprefix("  note: ") for line in lines if line.startswith("  note: ")]
    assert written[-2].startswith("false-alarm budget: ") and written[-1].startswith("power")
    # Where to act: the limit's key, and the command that recomputes the figure from this run's artifacts.
    command = RECOMPUTE.get(rule.name)
    limit = lines[-2] if command else lines[-1]
    setting = f"{SETTINGS[rule.kind]}.{verdict.outcome.limit_key}"
    assert limit.startswith(f"  limit: {directory / 'thresholds.toml'} {setting} = ")
    if command:
        assert lines[-1].startswith(f"  recompute: {command}")
    if test_name in EXPLAINED:  # the article's rules and the paired addition, in detail
        expected_rows, notes, exact = EXPLAINED[test_name]
        assert rows == expected_rows
        for start in notes:
            assert any(note.startswith(start) for note in written), (start, written)
        assert limit == f"  limit: {directory / 'thresholds.toml'} {exact}"


def test_the_flip_rule_shows_the_first_flipped_questions(verdicts: dict[tuple[str, str], Verdict]):
    text = verdicts["test_flips_within_noise_floor", "bad"].explain()
    listed = text[text.index("  first 3 flipped questions:\n"):].splitlines()[1:10]  # three lines each
    assert text.splitlines()[-2].startswith("  limit: ")  # after the questions
    for doc, baseline, candidate in zip(listed[::3], listed[1::3], listed[2::3]):
        assert doc.startswith("    doc ") and "(right to wrong), target '" in doc
        target = doc.rsplit("target ", 1)[1]
        assert baseline == f"      baseline : {target}"
        assert candidate == f"      candidate: '{int(target.strip(chr(39))) + 1}'"  # the fake's wrong answer
    assert "flipped questions" not in verdicts["test_flips_within_noise_floor", "good"].explain()


def test_the_accuracy_verdict_in_full(verdicts: dict[tuple[str, str], Verdict], directory: Path):
    # Answers are fixed by a checksum of each question, not by random draws: the exact text.
    assert verdicts["test_accuracy_within_se", "bad"].explain() == f"""\
accuracy FAILED for candidate bad on echo
  baseline accuracy                      0.825
  standard error                         0.0600781
  questions                              40
  candidate accuracy                     0.6
  drop caught with 80% power (addition)  0.140529
  threshold                              0.764922
  margin                                 -0.164922
  note: SE = sqrt(p(1-p)/n) with p the baseline accuracy; k = 1, one-sided (a drop fails)
  note: McNemar exact p on the flips: 0.003906 (an addition to the article)
  note: noise pass batch-order: accuracy 0.8250
  note: noise pass fp16: accuracy 0.8000
  note: false-alarm budget: off (run_alpha = 0), so each rule is judged at its own level
  note: power (an addition): a true drop of 0.140529 is caught with 80% probability; a pass does not rule out a \
smaller regression
  limit: {directory / "thresholds.toml"} tasks[0].limits.accuracy_se = 1
  recompute: fp8gate flips {directory / "artifacts/bf16/main/samples_echo.jsonl"} \
{directory / "artifacts/bad/main/samples_echo.jsonl"} --filter strict-match --metric exact_match"""


def test_the_artifacts_of_the_fake_run_are_the_gates(verdicts: dict[tuple[str, str], Verdict], directory: Path):
    # The same files a vLLM run writes, for fp8gate flips / compare-logprobs.
    artifacts = directory / "artifacts"
    for name in ("bf16/main", "bf16/batch-order", "bf16/fp16", "good/main", "bad/main"):
        assert (artifacts / name / "logprobs.npz").is_file() and (artifacts / name / "samples_echo.jsonl").is_file()
    assert (artifacts / "bad" / "engine.json").is_file() and (artifacts / "bad" / "provenance.json").is_file()
