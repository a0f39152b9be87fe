"""The load rule (issue 20) without vLLM: its judge on made-up levels, its config refusals, and the whole
gate over two fake endpoints, where a candidate that does not batch fails at the level it cannot carry and
a slow first token misses the TTFT SLO. The real ``vllm serve`` levels are in test_served_engine.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fake_endpoint import FakeEndpoint, Knobs
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import CPU_MIN_THROUGHPUT_FRACTION
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.rules import LoadLevel, throughput_under_load
from pytest_fp8gate.engines.load import bench_prompt_ids
from pytest_fp8gate.errors import CacheEntryError, ConfigError
from pytest_fp8gate.tools.demo.embedded import embedded_assets

MODEL = embedded_assets().model.as_posix()
LOAD = """
[load]
concurrencies = [1, 4]
requests = 4
input_len = 16
output_len = 16
min_throughput_fraction = 0.6
"""
# Tokens far apart, so that the fake's own time per request (HTTP, JSON, sharing the GIL with the gate in
# pytester's process, a busy machine) is small against it: 16 tokens take 0.16 s a request.
TOKEN_S = 0.01


def _level(c: int, tok_s: float, ttft: float = 0.01, tpot: float = 0.005) -> LoadLevel:
    return LoadLevel(c, 8, 8 * 10 / tok_s, 8 * 10, (ttft,) * 8, (tpot,) * 8)


# ---- the judge -------------------------------------------------------------------

def test_the_level_with_the_least_room_binds_and_is_named():
    base = [_level(1, 100), _level(8, 700), _level(64, 3000)]
    outcome = throughput_under_load([_level(1, 120), _level(8, 690), _level(64, 1500)], base, 0.8)
    assert not outcome.passed and outcome.bound_by == "concurrency 64"
    assert outcome.limit_key == "min_throughput_fraction" and outcome.measured == pytest.approx(0.5)
    assert outcome.margin == pytest.approx(-0.3) and outcome.figures["fraction_c8"] == pytest.approx(690 / 700)
    rows = dict(outcome.rows)
    assert rows["c=64 baseline output tok/s"] == pytest.approx(3000) and rows["c=1 fraction of baseline"] == 1.2
    assert throughput_under_load([_level(1, 120), _level(8, 690), _level(64, 2900)], base, 0.8).passed


def test_an_slo_binds_when_it_has_less_room_than_the_throughput_and_nan_misses_it():
    base = [_level(1, 100), _level(8, 700)]
    cand = [_level(1, 100, ttft=0.05), _level(8, 700, ttft=0.5)]
    outcome = throughput_under_load(cand, base, 0.8, {"max_ttft_p99_s": 0.4, "max_tpot_p99_s": None})
    assert not outcome.passed and (outcome.limit_key, outcome.bound_by) == ("max_ttft_p99_s", "concurrency 8")
    assert outcome.margin == pytest.approx(-0.1)
    silent = [LoadLevel(1, 8, 1.0, 80, (), ()), _level(8, 700)]  # no TPOT measured at c=1
    missed = throughput_under_load(silent, base, 0.5, {"max_tpot_p99_s": 1.0})
    assert not missed.passed and missed.limit_key == "max_tpot_p99_s" and missed.margin == -math.inf


def test_levels_that_do_not_match_or_a_silent_baseline_cannot_be_judged():
    with pytest.raises(ValueError, match="are not the baseline's"):
        throughput_under_load([_level(1, 1)], [_level(1, 1), _level(8, 1)], 0.8)
    with pytest.raises(ValueError, match="no output tokens at concurrency 1"):
        throughput_under_load([_level(1, 1)], [LoadLevel(1, 8, 1.0, 0, (), ())], 0.8)


# ---- config ----------------------------------------------------------------------

def _external(name: str, url: str) -> str:
    return f'name = "{name}"\nendpoint = "{url}"\nserved_model_name = "served-{name}"\nmodel = "{MODEL}"\n'


def _write(directory: Path, base_url: str, cand_url: str, load: str = LOAD) -> Path:
    path = directory / "thresholds.toml"
    path.write_text(f'device = "cpu"\n[baseline]\n{_external("bf16", base_url)}[[candidates]]\n'
                    f'{_external("fp8", cand_url)}{load}')
    return path


@pytest.mark.parametrize("edit, message", [
    (("[1, 4]", "[]"), "load.concurrencies: expected a non-empty array of positive integers"),
    (("[1, 4]", "[1, 0]"), "load.concurrencies: expected an integer >= 1, got 0"),
    (("[1, 4]", "[4, 4]"), "load.concurrencies: expected each concurrency at most once"),
    (("requests = 4", "requests = 2"), "load.requests: expected at least the highest concurrency, 4, got 2"),
    (("output_len = 16", "output_len = 1"), "load.output_len: expected an integer >= 2, got 1"),
    (("min_throughput_fraction = 0.6", "min_throughput_fraction = 0"),
     "load.min_throughput_fraction: expected a number > 0, got 0"),
    (("input_len = 16", "max_ttft_p99_s = -1"), "load.max_ttft_p99_s: expected a number > 0, got -1"),
    (("input_len = 16", "ttft_p99 = 1"), "load.ttft_p99: unknown key"),
])
def test_bad_load_settings_are_one_config_error(tmp_path: Path, edit: tuple[str, str], message: str):
    path = _write(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", LOAD.replace(*edit))
    with pytest.raises(ConfigError) as error:
        load_config(path)
    assert str(error.value).startswith(f"{path}: {message}") and "\n" not in str(error.value)


def test_load_is_refused_at_config_load_for_an_in_process_model(tmp_path: Path):
    path = tmp_path / "thresholds.toml"
    path.write_text(f'device = "cpu"\n[baseline]\nname = "bf16"\nmodel = "{MODEL}"\n[[candidates]]\nname = "fp8"\n'
                    f'quantization = "fp8_per_channel"\n{LOAD}')
    with pytest.raises(ConfigError, match=r"thresholds.toml: load: needs every model served, but baseline \(bf16\) "
                                          r"runs in-process \(vllm.LLM\); expected serve or endpoint"):
        load_config(path)
    spec = load_config(_write(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2",
                              LOAD.replace("requests = 4\n", ""))).load
    assert spec is not None and [spec.requests_at(c) for c in (1, 4, 8, 64)] == [16, 16, 32, 256]


def test_the_default_fraction_follows_the_device_whose_null_set_it(tmp_path: Path):
    """The H200's load null stayed within 1.1% of 1, a shared 2-core CPU's reached 0.60: each device
    gets a default below its own null, and a value in the file wins on either."""
    unset = LOAD.replace("min_throughput_fraction = 0.6\n", "")
    cpu = load_config(_write(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", unset)).load
    path = _write(tmp_path, "http://127.0.0.1:1", "http://127.0.0.1:2", unset)
    path.write_text(path.read_text().replace('device = "cpu"\n', ""))
    gpu = load_config(path).load
    assert cpu is not None and gpu is not None
    assert (cpu.min_throughput_fraction, gpu.min_throughput_fraction) == (CPU_MIN_THROUGHPUT_FRACTION, 0.9)
    path.write_text(path.read_text() + "min_throughput_fraction = 0.7\n")
    given = load_config(path).load
    assert given is not None and given.min_throughput_fraction == 0.7


# ---- through the whole gate --------------------------------------------------------

def _run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, dict]:
    result = pytester.runpytest("thresholds.toml", "-p", "pytest_jsonreport", "-p", "no:cacheprovider",
                                "--json-report", "--json-report-file=report.json", *args)
    tests = json.loads((pytester.path / "report.json").read_text())["tests"]
    return result, tests[0]["metadata"]["fp8gate"] if tests and "metadata" in tests[0] else {}


def _gate(pytester: pytest.Pytester, base: Knobs, cand: Knobs, load: str = LOAD,
          token_s: float = TOKEN_S) -> tuple[pytest.RunResult, dict]:
    base.model, cand.model = "served-bf16", "served-fp8"
    base.stream_token_s = cand.stream_token_s = token_s
    with FakeEndpoint(base) as base_url, FakeEndpoint(cand) as cand_url:
        _write(pytester.path, base_url, cand_url, load)
        return _run(pytester)


def test_a_candidate_as_fast_as_its_baseline_passes_with_every_level_side_by_side(pytester: pytest.Pytester):
    # Two equal fakes measure a fraction near 1, but on a loaded 2-core machine (load 5 to 10) a level came out
    # at 0.42 and below 0.3 with 10 ms between tokens: each wake-up of a sleeping stream (the fakes share the
    # gate's process) comes late by a few ms, and a stall of the process costs the short c=4 level most. With
    # 40 ms between tokens (8 of them, so the test takes about as long) that lateness is small against a
    # token; judged at 0.3, still above a serialized build's 1/4.
    loose = LOAD.replace("min_throughput_fraction = 0.6", "min_throughput_fraction = 0.3").replace(
        "output_len = 16", "output_len = 8")
    result, verdict = _gate(pytester, Knobs(), Knobs(kv_blocks=128), loose, token_s=4 * TOKEN_S)
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r"^load +fp8 +- +[\d.]+ +0.3 +\+[\d.]+ +pass$"])  # the summary's line
    assert verdict["rule"] == "load" and verdict["setting"].endswith("load.min_throughput_fraction = 0.3")
    assert verdict["limit_key"] == "min_throughput_fraction" and "figures" in verdict and "bound_by" in verdict
    levels, base = verdict["details"]["levels"], verdict["details"]["baseline_levels"]
    assert [level["concurrency"] for level in levels] == [1, 4] == [level["concurrency"] for level in base]
    assert all(math.isfinite(level[k]) for level in levels + base for k in ("output_tok_s", "ttft_p99_s", "tpot_p99_s"))
    assert (verdict["details"]["kv_cache_tokens"], verdict["details"]["baseline_kv_cache_tokens"]) == (2048, 1024)
    assert levels[1]["output_tok_s"] > 2 * levels[0]["output_tok_s"]  # four in flight beat one


def test_a_candidate_that_does_not_batch_fails_at_the_level_it_cannot_carry(pytester: pytest.Pytester):
    result, verdict = _gate(pytester, Knobs(), Knobs(serialized=True))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*load FAILED for candidate fp8*", "*c=4 fraction of baseline*",
                                 "*failed at concurrency 4 by load.min_throughput_fraction*",
                                 "*c=4, 4 requests: output tok/s baseline*"])
    fractions = {level: dict(verdict["rows"])[f"c={level} fraction of baseline"] for level in (1, 4)}
    assert fractions[4] < 0.5 < 0.7 < fractions[1]  # alike one at a time, far behind at four in flight


def test_a_first_token_slower_than_the_slo_fails_the_rule_by_its_setting(pytester: pytest.Pytester):
    slo = LOAD.replace("input_len = 16", "input_len = 16\nmax_ttft_p99_s = 0.1")
    result, verdict = _gate(pytester, Knobs(first_token_s=0.15), Knobs(first_token_s=0.15), slo)
    result.assert_outcomes(failed=1)
    assert verdict["setting"].endswith("load.max_ttft_p99_s = 0.1") and verdict["measured"] >= 0.15
    assert verdict["limit_key"] == "max_ttft_p99_s"
    result.stdout.fnmatch_lines(["*failed at concurrency * by load.max_ttft_p99_s*"])


def test_a_cached_baseline_brings_its_levels_and_one_without_them_is_measured(pytester: pytest.Pytester,
                                                                              tmp_path: Path):
    from pytest_fp8gate.run.cache_record import restore

    cache = tmp_path / "cache"
    cache.mkdir()
    with FakeEndpoint(Knobs(stream_token_s=TOKEN_S)) as base_url, \
            FakeEndpoint(Knobs(model="served-fp8", stream_token_s=TOKEN_S)) as cand_url:
        _write(pytester.path, base_url, cand_url)
        _, measured = _run(pytester, f"--fp8gate-baseline-cache={cache}")
        second, restored = _run(pytester, f"--fp8gate-baseline-cache={cache}")
    second.stdout.fnmatch_lines(["*baseline bf16 from the cache*"])
    assert restored["details"]["baseline_levels"] == measured["details"]["baseline_levels"]
    stored = json.loads(next(cache.glob("bf16-*/record.json")).read_text())
    key = json.loads(next(cache.glob("bf16-*/key.json")).read_text())
    assert [level["concurrency"] for level in stored["load"]] == [1, 4] and key["load"]["requests"] == [4, 4]
    with pytest.raises(CacheEntryError, match="has no load levels, which \\[load\\] needs"):
        restore({**stored, "load": None}, tmp_path, load_config(pytester.path / "thresholds.toml").baseline,
                 cache, key)
    assert rules.BY_NAME["load"].test == "test_throughput_under_load"


def test_bench_prompts_are_the_same_for_a_seed_and_stay_inside_the_vocabulary() -> None:
    prompts = bench_prompt_ids(259, 50, 3)
    assert prompts == bench_prompt_ids(259, 50, 3) != bench_prompt_ids(259, 50, 3, seed=1)
    assert [len(p) for p in prompts] == [50] * 3 and max(max(p) for p in prompts) < 259
    assert max(max(p) for p in bench_prompt_ids(128256, 2000, 2)) < 10000  # as vllm bench draws them
