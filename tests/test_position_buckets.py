"""Position buckets (issue 34): the figures per bucket of positions, and the bucket rules that judge the worst
bucket against the noise floor's same bucket. A fault that grows with position is caught by its bucket while
the whole-chunk mean passes. Through the fake engine; no vLLM."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from fakes import FakeEngine, FakeModel, fake_engine_class, fake_gate, logprob_run, thresholds_text, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.buckets import bucket_label, buckets_of, chunk_positions, sequence_positions
from pytest_fp8gate.core.logprobs import LogprobRun, compare_logprobs
from pytest_fp8gate.errors import ComparisonError, ConfigError, GateError
from pytest_fp8gate.face.cases import cases_for
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case, Verdict
from pytest_fp8gate.report import markdown_report
from pytest_fp8gate.run.record import Needs
from pytest_fp8gate.tools import cli

# Chunks of 400 tokens cut at 100, 200 and 300: four buckets of about 300 positions over the 3 chunks.
BUCKETS = "bucket_edges = [100, 200, 300]\nmin_bucket_positions = 250\n"
MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),
    # Exactly the baseline up to position 300, then a perturbation that grows with position.
    "drift": FakeModel(position_noise=0.45, position_onset=300, seed=5),
    "bad": FakeModel(logit_noise=0.5, seed=3),
}
BUCKET_RULES = tuple(rule.name for rule in rules.RULES if rule.kind == "bucket")


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def _edit(buckets: str = BUCKETS, per_bucket: bool = True):
    def edit(text: str) -> str:
        text = text.replace("top_k = 5\n", f"top_k = 5\n{buckets}", 1)
        if per_bucket:
            text = text.replace("[probabilities.limits]\n", "[probabilities.limits]\nper_bucket = true\n", 1)
        return text + '\n[[candidates]]\nname = "drift"\nquantization = "fp8_per_channel"\n'
    return edit


def _gate(tmp_path: Path, **kwargs) -> Gate:
    config = load_config(write_gate(tmp_path, _edit(**kwargs), task=False))
    needs = {name: Needs(probabilities=True) for name in MODELS}
    return fake_gate(config, tmp_path / "artifacts", needs, fake_engine_class(MODELS))


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Verdict]:
    gate = _gate(tmp_path_factory.mktemp("buckets"))
    names = ("same_top", "rms_dp", "mean_kl", "ppl_ratio", *BUCKET_RULES)
    return {(rule, name): gate.evaluate(Case(rule, name)) for rule in names for name in MODELS}


def test_the_position_growing_fault_is_caught_by_its_bucket_and_missed_by_the_whole_chunk(judged) -> None:
    whole, bucket = judged["mean_kl", "drift"], judged["bucket_mean_kl", "drift"]
    assert whole.passed, whole.explain()
    assert not bucket.passed, bucket.explain()
    assert bucket.details["bucket"] == "300+"
    # Both figures side by side: the worst bucket's KL is several times the whole chunk's.
    assert bucket.outcome.figures["whole_chunk"] == whole.outcome.measured
    assert bucket.outcome.measured > 3 * whole.outcome.measured
    assert bucket.outcome.measured > bucket.outcome.limit > whole.outcome.measured
    assert "worst bucket 300+" in bucket.explain()


def test_a_good_candidate_passes_every_bucket_rule_and_a_bad_one_fails_them(judged) -> None:
    for rule in BUCKET_RULES:
        assert judged[rule, "good"].passed, judged[rule, "good"].explain()
        assert not judged[rule, "bad"].passed, judged[rule, "bad"].explain()


def test_each_bucket_is_judged_against_the_floor_s_same_bucket(judged) -> None:
    verdict = judged["bucket_mean_kl", "good"]
    comparison, floors = verdict.details["comparison"], verdict.details["noise_floor"]
    assert [b["bucket"] for b in comparison["buckets"]] == ["0-100", "100-200", "200-300", "300+"]
    worst = next(b for b in comparison["buckets"] if b["bucket"] == verdict.details["bucket"])
    assert verdict.outcome.measured == worst["mean_kl"]
    floor_figures = [next(b["mean_kl"] for b in floor["buckets"] if b["bucket"] == worst["bucket"])
                     for floor in floors.values()]
    assert verdict.outcome.figures["noise_floor"] == max(floor_figures)
    assert sum(b["positions"] for b in comparison["buckets"]) == comparison["positions"] == 3 * 399


def test_a_bucket_with_too_few_positions_is_shown_but_not_judged(tmp_path: Path) -> None:
    gate = _gate(tmp_path, buckets="bucket_edges = [100, 200, 300]\nmin_bucket_positions = 298\n")
    verdict = gate.evaluate(Case("bucket_mean_kl", "good"))
    assert any(note.startswith("bucket 0-100: 297 positions") and "not judged" in note for note in verdict.notes)
    assert verdict.outcome.measured != verdict.details["comparison"]["buckets"][0]["mean_kl"]


def test_no_bucket_large_enough_is_a_clear_failure_not_a_pass(tmp_path: Path) -> None:
    gate = _gate(tmp_path, buckets="min_bucket_positions = 5000\n")
    with pytest.raises(GateError, match=r"probabilities\.min_bucket_positions: no position bucket holds 5000 "
                                        r"scored positions \(0-1k: 1197\)"):
        gate.evaluate(Case("bucket_mean_kl", "good"))


def test_the_bucket_rules_are_collected_only_with_per_bucket(tmp_path: Path) -> None:
    (tmp_path / "on").mkdir(), (tmp_path / "off").mkdir()
    on = load_config(write_gate(tmp_path / "on", _edit(), task=False))
    off = load_config(write_gate(tmp_path / "off", _edit(per_bucket=False), task=False))
    for rule in rules.RULES:
        if rule.kind == "bucket":
            assert [p.values[0].candidate for p in cases_for(rule.test, on, FakeEngine)] == ["good", "bad", "drift"]
            assert cases_for(rule.test, off, FakeEngine) == []


@pytest.mark.parametrize(("line", "message"), [
    ("bucket_edges = [1024, 512]", "probabilities.bucket_edges: expected an array of rising positive integers"),
    ("bucket_edges = 1024", "probabilities.bucket_edges: expected an array of rising positive integers"),
    ("bucket_edges = [0, 512]", "probabilities.bucket_edges: expected an array of rising positive integers"),
    ("min_bucket_positions = 0", "probabilities.min_bucket_positions: expected an integer >= 1, got 0"),
])
def test_bad_bucket_settings_are_refused_naming_the_key(tmp_path: Path, line: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        load_config(write_gate(tmp_path, _edit(buckets=line + "\n"), task=False))


def test_per_bucket_must_be_a_boolean(tmp_path: Path) -> None:
    def edit(text: str) -> str:
        return text.replace("[probabilities.limits]\n", "[probabilities.limits]\nper_bucket = 1\n", 1)
    with pytest.raises(ConfigError, match=r"probabilities\.limits\.per_bucket: expected true or false"):
        load_config(write_gate(tmp_path, edit, task=False))


# ---- the pure parts ------------------------------------------------------------

def test_bucket_labels_and_row_positions() -> None:
    assert [bucket_label(a, b) for a, b in ((0, 1024), (1024, 4096), (4096, 16384), (16384, None))] == [
        "0-1k", "1k-4k", "4k-16k", "16k+"]
    assert bucket_label(0, 100) == "0-100"
    assert chunk_positions(6, 4).tolist() == [1, 2, 3, 1, 2, 3]
    with pytest.raises(ComparisonError, match="not whole chunks of 4 tokens"):
        chunk_positions(7, 4)
    assert sequence_positions([3, 5], [2, 1]).tolist() == [3, 4, 5]
    assert [label for label, *_ in buckets_of(np.array([1, 2, 1030, 5000]), (1024, 4096, 16384))] == [
        "0-1k", "1k-4k", "4k-16k"]  # an empty bucket is left out


def _rows(run: LogprobRun, mask: np.ndarray) -> LogprobRun:
    assert run.full_logprobs is not None and run.token_ids is not None
    return LogprobRun(run.real_logprob[mask], run.top_ids[mask], run.top_logprobs[mask],
                      full_logprobs=run.full_logprobs[mask], token_ids=run.token_ids[mask])


def test_each_bucket_s_figures_are_the_comparison_of_its_rows_alone() -> None:
    base, cand = logprob_run(0), logprob_run(1, 0.3)
    positions = chunk_positions(base.positions, 201)
    whole = compare_logprobs(base, cand, positions, (50, 150))
    assert [b.label for b in whole.buckets] == ["0-50", "50-150", "150+"]
    assert whole.as_dict()["buckets"][1]["bucket"] == "50-150"
    for bucket in whole.buckets:
        mask = (positions >= bucket.start) & (positions < (bucket.end or 10**9))
        alone = compare_logprobs(_rows(base, mask), _rows(cand, mask), positions[mask])
        assert bucket.comparison.as_dict() == {**alone.as_dict(), "buckets": []}
    unbucketed = compare_logprobs(base, cand, positions).as_dict()
    assert {**unbucketed, "buckets": []} == {**whole.as_dict(), "buckets": []}


def test_the_report_shows_every_model_s_figures_per_bucket_with_or_without_the_bucket_rule(tmp_path: Path) -> None:
    gate = _gate(tmp_path, per_bucket=False)
    verdicts = [gate.evaluate(Case("mean_kl", name)) for name in MODELS]
    lines = markdown_report._bucket_lines([v for v in verdicts if v.case.candidate == "drift"])
    assert lines[0].startswith("Probabilities per position bucket (positions in tokens; the whole: 1197 positions")
    rows = [line for line in lines if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["0-100", "100-200", "200-300", "300+"]
    kl = {row.split("|")[1].strip(): float(row.split("|")[5]) for row in rows}
    assert kl["0-100"] == kl["100-200"] == kl["200-300"] == 0.0 < kl["300+"]  # the plant starts at 300
    # The JSON carries them too: the verdict's comparison and each floor's.
    data = verdicts[0].as_dict()
    assert len(data["details"]["comparison"]["buckets"]) == 4
    assert all(len(floor["buckets"]) == 4 for floor in data["details"]["noise_floor"].values())


DECODE = "[decode]\nprompts = 3\nprompt_tokens = 250\nnew_tokens = 100\n[decode.limits]\nmax_mean_kl = 0.001355\n"


def test_the_decode_phase_figures_come_per_bucket_of_generated_positions(tmp_path: Path) -> None:
    def edit(text: str) -> str:
        text = _edit()(text)
        return text.replace("[[candidates]]", DECODE + "\n[[candidates]]", 1)
    config = load_config(write_gate(tmp_path, edit, task=False))
    needs = {"drift": Needs(probabilities=True, decode=True)}
    gate = fake_gate(config, tmp_path / "artifacts", needs, fake_engine_class(MODELS))
    verdict = gate.evaluate(Case("decode_mean_kl", "drift"))
    buckets = verdict.details["comparison"]["logprobs"]["buckets"]
    # Generated positions 250..349: the 200-300 bucket (the decode noise alone, before the plant starts) and 300+.
    assert [(b["bucket"], b["positions"]) for b in buckets] == [("200-300", 150), ("300+", 150)]
    assert buckets[0]["mean_kl"] < 0.1 * buckets[1]["mean_kl"]
    # The decode phase's additions per bucket too: reverse KL grows with the plant, acceptance falls.
    additions = verdict.details["comparison"]["bucket_additions"]
    assert list(additions) == ["200-300", "300+"]
    assert additions["200-300"]["mean_reverse_kl"] < 0.1 * additions["300+"]["mean_reverse_kl"]
    assert additions["200-300"]["acceptance_rate"] > additions["300+"]["acceptance_rate"]
    assert any(line.startswith("Decode phase (baseline's continuations) per position bucket")
               for line in markdown_report._bucket_lines([verdict]))


def test_chunk_tokens_max_model_len_takes_the_least_context_of_the_models(tmp_path: Path) -> None:
    def edit(text: str, candidate_len: str = "") -> str:
        text = text.replace("chunk_tokens = 400", 'chunk_tokens = "max_model_len"')
        text = text.replace("chunks = 3\n", "chunks = 2\n")  # all the 6,000-byte corpus can hold of 2,047 tokens
        return text.replace('name = "bad"\nquantization = "fp8_per_channel"\n',
                            f'name = "bad"\nquantization = "fp8_per_channel"\n{candidate_len}', 1)
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    # The baseline's engine.max_model_len, 2,048, less the token vLLM generates after a scored prompt.
    spec = load_config(write_gate(tmp_path / "a", edit, task=False)).probabilities
    assert spec is not None and spec.chunk_tokens == 2047
    spec = load_config(write_gate(tmp_path / "b", lambda t: edit(t, "engine = { max_model_len = 1024 }\n"),
                                  task=False)).probabilities
    assert spec is not None and spec.chunk_tokens == 1023


def test_chunk_tokens_takes_a_number_or_max_model_len_only(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r'probabilities\.chunk_tokens: expected an integer >= 2 or "max_model_len", '
                                          r"got string 'longest'"):
        load_config(write_gate(tmp_path, lambda t: t.replace("chunk_tokens = 400", 'chunk_tokens = "longest"'),
                               task=False))


def test_chunk_tokens_max_model_len_needs_each_model_s_context(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text('[probabilities]\nchunk_tokens = "max_model_len"\n[probabilities.limits]\n'
                                    "max_mean_kl = 0.01"))
    with pytest.raises(ConfigError, match=r'probabilities\.chunk_tokens: "max_model_len" needs the context of each '
                                          r"model, but bf16 has no engine\.max_model_len"):
        load_config(path)


def test_the_bucket_verdict_s_recompute_command_gives_its_bucket_s_figure(judged, capsys) -> None:
    verdict = judged["bucket_mean_kl", "drift"]
    assert verdict.recompute is not None and verdict.recompute.endswith("--chunk-tokens 400 --bucket-edges 100,200,300")
    assert cli.main([*shlex.split(verdict.recompute)[1:], "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    worst = next(b for b in figures["buckets"] if b["bucket"] == "300+")
    assert worst["mean_kl"] == pytest.approx(verdict.outcome.measured, rel=1e-6)
    assert judged["mean_kl", "drift"].recompute.split()[-1].endswith("logprobs.npz")  # the whole chunk's: no buckets
