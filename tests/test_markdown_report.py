from __future__ import annotations

import dataclasses
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from fakes import (
    TASK,
    fake_baseline,
    logprob_run,
    make_measurements,
    sample_rows,
    write_pass,
    write_recorded_gate,
)
from pytest_fp8gate.core import rules
from pytest_fp8gate.engines.base import Latency
from pytest_fp8gate.judge.comparisons import Comparisons
from pytest_fp8gate.judge.verdict import Case, Verdict
from pytest_fp8gate.report import markdown_report, plots
from pytest_fp8gate.report.markdown_report import ReportData, first_divergence, render, write
from pytest_fp8gate.run.record import ModelResult

FLIPPED_TEXT = {3: "We add one and one so the answer is 2.", 7: "We add one and two so the answer is 7."}


@pytest.fixture
def data(tmp_path: Path) -> ReportData:
    """A baseline with its noise passes, one measured candidate, and verdicts of four rules."""
    measurements = make_measurements(write_recorded_gate(tmp_path / "gate"), tmp_path / "artifacts")
    measurements._measure_baseline_engines = fake_baseline(measurements)
    record = measurements.record()
    record.result.latency = Latency(1000, 256, 1, 10, 2.0, 0.1)
    config = measurements.config
    cand_main = write_pass(tmp_path / "artifacts" / "fp8", "main", logprob_run(5, 0.2),
                           sample_rows({4, 7}, FLIPPED_TEXT))  # doc 3 wrong -> right, doc 7 right -> wrong
    # Timed until the SE of the mean was within 1%: 4 iterations, 0.4% (addition).
    latency = Latency(1000, 256, 1, 4, 1.5, 0.1, decode_rel_se=0.004, target_rel_se=0.01)
    candidate = ModelResult(config.candidates[0], cand_main, 2.0, 8192, 8, latency)
    measurements._candidates["fp8"] = candidate
    verdicts = [
        Verdict(Case("flips", "fp8", TASK), rules.flips_within_noise_floor(2, 2, 30, ratio=2.0)),
        Verdict(Case("accuracy", "fp8", TASK), rules.accuracy_within_se(28 / 30, 28 / 30, 30),
                {"noise_floor": {"batch-order": {"accuracy_cand": 28 / 30}, "fp16": {"accuracy_cand": 0.9}}}),
        Verdict(Case("mean_kl", "fp8"), rules.at_most("mean_kl", 0.02, 0.01, 0.0005)),
    ]
    unjudged = [(Case("speed", "fp8"), "skipped: no memory-bandwidth figure for the CPU engine")]
    provenance = dict(measurements.provenance(config.baseline), engine_runs=record.engine_runs,
                      models={"bf16": measurements.fingerprint(config.baseline)})
    return ReportData(config, verdicts, record, {"fp8": candidate}, provenance, Comparisons(config, measurements),
                      unjudged)


def test_report_tables_flips_commands_and_provenance(data: ReportData, tmp_path: Path):
    text = render(data, None).markdown
    assert "# fp8gate report: bf16 against fp8" in text
    assert "Rules: 3 judged, 2 passed, 1 failed, 1 not judged." in text
    assert "## fp8: FAIL" in text
    header = next(line for line in text.splitlines() if line.startswith("| rule"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "rule", "task", "measured", "noise floor", "threshold", "margin", "result"]
    kl_row = next(line for line in text.splitlines() if line.startswith("| mean_kl"))
    assert [c.strip() for c in kl_row.strip("|").split("|")] == [
        "mean_kl", "-", "0.02", "0.0005", "0.01", "-0.01", "**FAIL**"]
    assert "| batch-order 0.9333, fp16 0.9 |" in text  # the accuracy rule's floor: the noise passes' accuracy
    assert "\nNot judged: speed: skipped: no memory-bandwidth figure for the CPU engine\n" in text
    # Every row of a table is padded to the same width: it reads as plain text.
    table_lines = [line for line in text.splitlines() if line.startswith(("| rule", "|-", "| flips", "| mean_kl"))][:4]
    assert len({len(line) for line in table_lines}) == 1
    assert "Speed: decode 182.1 tok/s at batch 1, 1000 tokens in, 256 out, median of 4 (SE of the mean 0.40%, " \
           "target 1.00%) (baseline 134.2 tok/s, 1.36x)." in text
    assert "KV-cache capacity: 8,192 tokens (baseline 4,096 tokens, 2.00x)." in text
    assert ("### Flipped questions on tiny: 2 of 30 (1 right → wrong, 1 wrong → right; "
            "noise floor: batch-order 0, fp16 2)") in text
    assert "- doc 3, wrong → right, target “2”: baseline answered “7”, candidate “2”" in text
    assert "  first diverging word 10, after “and one so the answer is”: baseline “7.”, candidate “2.”" in text
    assert "  first diverging word 5, after “We add one and”: baseline “one so the answer is 2.”, " \
           "candidate “two so the answer is 7.”" in text
    artifacts = tmp_path / "artifacts"
    assert (f"fp8gate compare-logprobs {artifacts}/bf16/main/logprobs.npz {artifacts}/fp8/main/logprobs.npz"
            in text)
    assert f"fp8gate compare-logprobs {artifacts}/bf16/main/logprobs.npz {artifacts}/bf16/fp16/logprobs.npz" \
           "   # noise floor: fp16" in text
    assert (f"fp8gate flips {artifacts}/bf16/main/samples_tiny.jsonl {artifacts}/fp8/main/samples_tiny.jsonl "
            "--filter strict-match --metric exact_match") in text
    assert "## Provenance" in text and "| vllm " in text and "| lm-eval " in text and "| transformers " in text
    assert "CPU: " in text or "GPUs: " in text
    assert "| bf16   | 2026-12-01T09:00:00+00:00 | 12.5 s | 3.0 s   | 0 " in text
    assert "Corpus: file=" in text and "Task tiny (tiny_task): files sha256 " in text
    assert "Plots: not drawn (pass --fp8gate-report PATH" in text


def test_first_divergence_handles_prefixes_and_equal_text():
    assert first_divergence("a b c", "a b") == "word 3, after “a b”: baseline “c”, candidate (ends)"
    assert first_divergence("x", "y") == "word 1: baseline “x”, candidate “y”"
    assert "the same word for word" in first_divergence("a  b", "a b")


def test_written_with_plots_and_appended_to_the_step_summary(data: ReportData, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("matplotlib")
    summary = tmp_path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    report = tmp_path / "out" / "gate.md"
    written = write(data, report)
    names = ["gate-fp8-dp.png", "gate-fp8-kl.png", "gate-fp8-flips-tiny.png"]
    assert written == [report, *(report.parent / n for n in names), summary]
    text = report.read_text()
    for name in names:
        assert f"]({name})" in text
        assert (report.parent / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    steps = summary.read_text()
    assert steps.startswith("earlier step\n# fp8gate report")
    assert "![" not in steps and f"Plot fp8: Δp per position: {report.parent / names[0]}" in steps


def test_without_matplotlib_the_report_says_how_to_get_plots(data: ReportData, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(plots, "available", lambda: False)
    markdown_report.write(data, tmp_path / "r.md")
    assert "Plots: not drawn: matplotlib is not installed (pip install 'pytest-fp8gate[report]')." in \
           (tmp_path / "r.md").read_text()
    assert not list(tmp_path.glob("*.png"))


JUNIT_TEST = """
import pytest
from pytest_fp8gate.core import rules
from pytest_fp8gate.face.session import VERDICT_KEY
from pytest_fp8gate.judge.comparisons import Comparisons
from pytest_fp8gate.judge.verdict import Case, Verdict

# What GateSession.enforce does: the verdict goes on the item, then a failing rule fails the test.
def test_flips(request):
    request.node.stash[VERDICT_KEY] = Verdict(Case("flips", "fp8", "tiny"), rules.flips_within_noise_floor(1, 2, 100))

def test_kl(request):
    request.node.stash[VERDICT_KEY] = Verdict(Case("mean_kl", "fp8"), rules.at_most("mean_kl", 0.02, 0.01, 0.001))
    pytest.fail("mean_kl FAILED", pytrace=False)
"""


@pytest.mark.parametrize("family", ["xunit2", "xunit1"])
def test_rule_numbers_land_in_junit_properties(pytester: pytest.Pytester, family: str):
    pytester.makepyfile(JUNIT_TEST)
    # A gate option asks for the gate (and its report hooks) in a run with no rule test.
    result = pytester.runpytest("--junitxml=junit.xml", "-o", f"junit_family={family}", "--fp8gate-allow-no-rules")
    result.assert_outcomes(passed=1, failed=1)
    cases = {case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
             for case in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")}
    additions = {key: float(cases["test_flips"].pop(f"fp8gate.row.{key}")) for key in
                 ("p, exact test of flips <= 2 x floor (addition)", "margin in SE of the rates (addition)",
                  rules.RESOLUTION_ROW)}
    # 1 flip against a floor of 2: P(X >= 1) for Binomial(3, 2/3) = 26/27; (0.04 - 0.01) / SE.
    assert additions["p, exact test of flips <= 2 x floor (addition)"] == pytest.approx(26 / 27)
    assert additions["margin in SE of the rates (addition)"] == pytest.approx(
        0.03 / math.sqrt(0.01 * 0.99 / 100 + 4 * 0.02 * 0.98 / 100))
    assert 0.02 < additions[rules.RESOLUTION_ROW] < 0.2
    assert cases["test_flips"] == {
        "fp8gate.rule": "flips", "fp8gate.candidate": "fp8", "fp8gate.task": "tiny",
        "fp8gate.passed": "True", "fp8gate.measured": "1.0", "fp8gate.noise_floor": "2",
        "fp8gate.threshold": "4.0", "fp8gate.margin": "3.0", "fp8gate.row.questions": "100.0",
        "fp8gate.row.noise floor flips": "2.0", "fp8gate.row.2 x noise floor": "4.0",
        "fp8gate.row.minimum allowance": "1.0", "fp8gate.row.candidate flips": "1.0",
        "fp8gate.row.threshold": "4.0", "fp8gate.row.margin": "3.0"}
    assert cases["test_kl"]["fp8gate.passed"] == "False"
    assert cases["test_kl"]["fp8gate.measured"] == "0.02" and cases["test_kl"]["fp8gate.noise_floor"] == "0.001"


SESSION_TEST = """
from pytest_fp8gate.core import rules
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.face.session import GateSession, run_state
from pytest_fp8gate.judge.verdict import Case, Verdict

def test_rule(pytestconfig, tmp_path):
    # What the fp8gate fixture and GateSession.enforce leave behind, without an engine.
    GateSession(pytestconfig, load_config({config!r}), tmp_path)
    verdict = Verdict(Case("mean_kl", "fp8"), rules.at_most("mean_kl", 0.002, 0.01, 0.001))
    run_state(pytestconfig).verdicts.append(verdict)
"""


def test_the_report_is_written_at_session_end(pytester: pytest.Pytester, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    pytester.makepyfile(SESSION_TEST.format(config=str(write_recorded_gate(tmp_path / "gate"))))
    result = pytester.runpytest("--fp8gate-report", "out/gate.md")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["fp8gate report: out/gate.md"])
    text = (pytester.path / "out" / "gate.md").read_text()
    assert "| mean_kl | -    | 0.002    | 0.001       | 0.01      | +0.008 | pass   |" in text
    assert "## fp8: pass" in text and "## Provenance" in text


def test_a_report_that_cannot_be_written_warns_and_keeps_the_exit_status(pytester: pytest.Pytester,
                                                                         tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    pytester.makepyfile(SESSION_TEST.format(config=str(write_recorded_gate(tmp_path / "gate"))))
    (pytester.path / "blocked").write_text("a file where the report's directory should be")
    result = pytester.runpytest("--fp8gate-report", "blocked/gate.md")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["fp8gate: the markdown report was not written: FileExistsError: *blocked*"])


def test_the_report_says_what_each_engine_ran(data: ReportData):
    stack = {"model_runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner", "attention_backends": ["FLASH_ATTN"],
             "compilation_mode": "CompilationMode.VLLM_COMPILE", "cudagraph_mode": "CUDAGraphMode.FULL_AND_PIECEWISE",
             "linear_layers": {"Fp8LinearMethod [CutlassFP8ScaledMMLinearKernel]": 4}}
    runs = [dict(data.provenance["engine_runs"][0], vllm={"stack": stack}, env={"VLLM_X": "1"})]
    text = render(dataclasses.replace(data, provenance=dict(data.provenance, engine_runs=runs)), None).markdown
    assert ("- bf16 (env: VLLM_X=1): runner GPUModelRunner; attention FLASH_ATTN; compile "
            "CompilationMode.VLLM_COMPILE; CUDA graphs CUDAGraphMode.FULL_AND_PIECEWISE; "
            "4 x Fp8LinearMethod [CutlassFP8ScaledMMLinearKernel]") in text


def test_the_report_tables_each_rule_s_share_of_the_budget_and_its_power(data: ReportData):
    budget = {"run_alpha": 0.05, "rules": 2, "level": 0.025, "p_value": 0.0, "rank": 1}
    outcome = rules.at_most("mean_kl", 0.02, 0.01, 0.0005, measured_se=0.001, k_se=1.96)
    kl = data.verdicts[2] = dataclasses.replace(data.verdicts[2], outcome=outcome, details={"budget": budget})
    text = render(data, None).markdown
    assert ("False alarms and power (additions): the rules that are tests share run_alpha = 0.05 by Holm" in text)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and line.count("|") == 7}
    assert rows["mean_kl"] == ["mean_kl", "-", "0", "0.025", "mean_kl", f"{kl.outcome.figures['resolution']:.6g}"]
    assert rows["accuracy"][2:] == ["-", "none (not a test)", "-", "-"]  # no resolution without the churn
    assert rows["flips"][4] == "flip rate"  # the rule's own unit
