"""Served faults (issue 30) through the whole gate and the fake endpoint: a request never answered, an
answer dripped a byte at a time, load streams that fail, an error quoting the key, an unset key variable,
a redeploy behind a cached baseline's URL and name, a failed start's log file.

Each run fails (or refuses) with one line naming the model or URL, no traceback, no key in any output or
written file, within the deadline plus 10 s, and leaves no process behind.
"""

from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from fake_endpoint import FakeEndpoint, Knobs
from pytest_fp8gate.config.spec import GateConfig
from pytest_fp8gate.engines import lifecycle, server_process
from pytest_fp8gate.errors import ConfigError, EndpointError
from test_served import MODEL, PROBABILITY_RULES, _config, _external

KEY = "sk-fp8gate-fault-0123456789abcdef"
KEY_ENV = "FP8GATE_FAULT_KEY"
SLACK_S = 10.0  # a hang or a drip ends within its deadline plus this
LOAD = """
[load]
concurrencies = [1, 4]
requests = 4
input_len = 16
output_len = 8
min_throughput_fraction = 0.1
"""


@pytest.fixture(autouse=True)
def _key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


def _keyed(url: str, name: str = "served-bf16", **keys: str) -> str:
    return _external(url, **{"api_key_env": KEY_ENV, **keys}).replace("served-bf16", name)


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """The gate over the thresholds file there, with every output it writes; none may hold the key, and no
    process it started may outlive it."""
    before = lifecycle.child_pids()  # an earlier test's engine run leaves vLLM's resource tracker
    result = pytester.runpytest("thresholds.toml", "-p", "pytest_jsonreport", "-p", "no:cacheprovider",
                                "--fp8gate-artifacts=artifacts", "--fp8gate-report=report.md",
                                "--json-report", "--json-report-file=report.json", *args)
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output
    assert KEY not in output
    written = [p for p in pytester.path.rglob("*") if p.is_file() and p.name != "thresholds.toml"]
    assert any(p.name == "report.md" for p in written) and any(p.name == "report.json" for p in written)
    for path in written:
        assert KEY not in path.read_text(errors="replace"), path
    assert lifecycle.child_pids() <= before
    return result


def _gave_up_after(result: pytest.RunResult) -> float:
    return float(re.search(r"gave up after ([\d.]+) s", result.stdout.str()).group(1))  # type: ignore[union-attr]


def _gate(pytester: pytest.Pytester, base: Knobs, cand: Knobs, *args: str, base_lines: str = "",
          cand_keys: dict | None = None, load: str | None = None) -> pytest.RunResult:
    """The gate of test_served's thresholds over two keyed fakes; with ``load``, its [load] rule alone."""
    base.api_key = cand.api_key = KEY
    cand.model = "served-fp8"
    with FakeEndpoint(base) as base_url, FakeEndpoint(cand) as cand_url:
        path = _config(pytester.path, _keyed(base_url) + base_lines,
                       _keyed(cand_url, "served-fp8", **(cand_keys or {})))
        if load is not None:
            path.write_text(path.read_text().split("[probabilities]")[0] + load)
        return _run(pytester, *args)


# ---- the deadline's settings ---------------------------------------------------------

def _served_setting(tmp_path: Path, line: str) -> tuple[Path, GateConfig]:
    """Two keyed endpoints, ``line`` in the baseline's table only; the file and its config."""
    from pytest_fp8gate.config.loader import load_config

    path = _config(tmp_path, _keyed("http://127.0.0.1:1") + f"\n{line}", _keyed("http://127.0.0.1:2", "served-fp8"))
    config = load_config(path)
    assert config.baseline.served is not None and config.candidates[0].served is not None
    return path, config


def _refused_off_a_served_model(path: Path, line: str) -> None:
    """``line`` in an in-process baseline's table is refused, naming its key."""
    from pytest_fp8gate.config.loader import load_config

    path.write_text(f'[baseline]\nname = "bf16"\nmodel = "{MODEL}"\n{line}\n[[candidates]]\n'
                    'name = "fp8"\nquantization = "fp8_per_channel"\n[speed]\n')
    key = line.split(" = ")[0]
    with pytest.raises(ConfigError, match=rf"baseline.{key}: applies only to a served model"):
        load_config(path)


def test_the_deadline_is_a_served_model_s_setting_and_the_option_sets_every_one(tmp_path: Path):
    from pytest_fp8gate.config.loader import load_config
    from pytest_fp8gate.config.spec import with_request_deadline

    path, config = _served_setting(tmp_path, "request_deadline_s = 30")
    assert config.baseline.served is not None and config.candidates[0].served is not None
    assert (config.baseline.served.request_deadline_s, config.candidates[0].served.request_deadline_s) == (30, 600)
    overridden = with_request_deadline(config, 2.5)
    assert [m.served.request_deadline_s for m in (overridden.baseline, *overridden.candidates) if m.served] == [2.5] * 2
    path.write_text(path.read_text().replace("request_deadline_s = 30", "request_deadline_s = 0"))
    with pytest.raises(ConfigError, match=r"thresholds.toml: baseline.request_deadline_s: expected a number > 0, "
                                          r"got 0$"):
        load_config(path)
    _refused_off_a_served_model(path, "request_deadline_s = 5")


def test_requests_in_flight_are_a_served_model_s_setting_that_keys_its_baseline(tmp_path: Path):
    from pytest_fp8gate.config.loader import load_config
    from pytest_fp8gate.engines.served_engine import cache_key

    path, config = _served_setting(tmp_path, "max_in_flight = 16")
    assert config.baseline.served is not None and config.candidates[0].served is not None
    assert (config.baseline.served.max_in_flight, config.candidates[0].served.max_in_flight) == (16, 1024)
    assert cache_key(config.baseline.served)["max_in_flight"] == 16
    for bad in ("0", "2.5", '"all"'):
        path.write_text(re.sub(r"max_in_flight = \S+", f"max_in_flight = {bad}", path.read_text()))
        with pytest.raises(ConfigError, match=r"thresholds.toml: baseline.max_in_flight: expected an integer"):
            load_config(path)
    _refused_off_a_served_model(path, "max_in_flight = 8")


@pytest.mark.parametrize("value", ["0", "-1", "soon", "inf", "nan"])
def test_a_bad_deadline_option_is_a_usage_error(pytester: pytest.Pytester, value: str):
    _config(pytester.path, _keyed("http://127.0.0.1:1"), _keyed("http://127.0.0.1:2", "served-fp8"))
    result = pytester.runpytest("thresholds.toml", f"--fp8gate-request-deadline={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*--fp8gate-request-deadline {value}: expected a number of seconds above 0"])


TLS = Path(__file__).parent / "data" / "tls"


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_the_deadline_bounds_the_whole_request_however_its_bytes_arrive(monkeypatch: pytest.MonkeyPatch, tls: bool):
    """A per-read timeout of 1 s never fires on a byte every 0.3 s; the whole-request deadline does, over TLS
    too, and a prompt answer is read in full."""
    from pytest_fp8gate.engines.http_client import EndpointClient
    from pytest_fp8gate.errors import EndpointTimeout

    monkeypatch.setenv("SSL_CERT_FILE", str(TLS / "cert.pem"))  # the client verifies the fake's certificate
    files = (str(TLS / "cert.pem"), str(TLS / "key.pem")) if tls else None
    with FakeEndpoint(Knobs(tls=files)) as url:
        assert url.startswith("https://" if tls else "http://")
        assert EndpointClient(url, deadline_s=1.0).get("/version") == {"version": "0.0.0-fake"}
    with FakeEndpoint(Knobs(tls=files, drip_s=0.3)) as url:
        started = time.monotonic()
        with pytest.raises(EndpointTimeout, match=r"/v1/models: no complete answer within the request deadline of "
                                                  r"1 s \(request_deadline_s\); gave up after 1\.\d s$"):
            EndpointClient(url, deadline_s=1.0).get("/v1/models")
        assert time.monotonic() - started < 1 + SLACK_S


def test_a_hung_server_costs_one_deadline_not_one_per_request():
    """More chunks than max_in_flight, none answered: the first deadline aborts those in flight, the rest never
    go out. (A smaller cap than the default's 1,024: the fake accepts one connection at a time.)"""
    from pytest_fp8gate.config.spec import ModelSpec, ServedSpec
    from pytest_fp8gate.engines.vllm_served import VllmServedEngine
    from pytest_fp8gate.errors import EndpointTimeout

    in_flight = 64

    fake = FakeEndpoint(Knobs(hang_after=2))
    with fake as url:
        spec = ModelSpec("bf16", MODEL, None, {}, served=ServedSpec("served-bf16", endpoint=url, request_deadline_s=1,
                                                                    max_in_flight=in_flight))
        engine = VllmServedEngine(spec, max_logprobs=5)
        started = time.monotonic()
        with pytest.raises(EndpointTimeout, match="gave up after 1"):
            engine.prompt_logprobs([[1, 2, 3]] * (in_flight + 8), 5, False)
        took = time.monotonic() - started
        engine.shutdown()
    # Some of those in flight may still be connecting (the fake accepts one at a time): at most the socket's
    # own timeout, a second past the deadline, ends them.
    assert took < 1 + SLACK_S and len(fake.hung_at) <= in_flight


# ---- faults through the whole gate ------------------------------------------------------

def test_a_request_never_answered_after_the_probe_ends_at_the_option_s_deadline(pytester: pytest.Pytester):
    fake = FakeEndpoint(Knobs(api_key=KEY, hang_after=2))  # the probe's two completions answered, no chunk
    with fake as base_url, FakeEndpoint(Knobs(model="served-fp8", api_key=KEY)) as cand_url:
        _config(pytester.path, _keyed(base_url), _keyed(cand_url, "served-fp8"))
        result = _run(pytester, "--fp8gate-request-deadline=1")
        ended = time.monotonic()
    hung = list(fake.hung_at)
    result.assert_outcomes(failed=PROBABILITY_RULES)
    result.stdout.fnmatch_lines(["*measuring bf16: http://127.0.0.1:*/v1/completions: no complete answer within "
                                 "the request deadline of 1 s (request_deadline_s); gave up after 1.* s*"])
    assert len(hung) == 1 and ended - hung[0] < 1 + SLACK_S


def test_an_answer_dripped_a_byte_at_a_time_ends_at_the_model_s_deadline(pytester: pytest.Pytester):
    started = time.monotonic()
    result = _gate(pytester, Knobs(drip_s=0.5), Knobs(), base_lines="\nrequest_deadline_s = 2")
    result.assert_outcomes(failed=PROBABILITY_RULES)
    result.stdout.fnmatch_lines(["*measuring bf16: http://127.0.0.1:*/v1/models: no complete answer within the "
                                 "request deadline of 2 s (request_deadline_s); gave up after * s*"])
    assert _gave_up_after(result) < 2 + SLACK_S and time.monotonic() - started < 2 + SLACK_S + 20


@pytest.mark.parametrize("fault, message", [
    ("abort", "a stream ended after 1 of 8 tokens with finish_reason 'abort' (a complete one ends with 'length')"),
    ("error-event", "the stream carried an error event: the engine core died mid-request"),
    ("drop", "the stream ended without its closing [[]DONE[]] (the connection dropped mid-stream)"),
    ("status", "HTTP 500: EngineCore encountered an issue"),
], ids=["abort", "error-event", "drop", "status"])
def test_a_load_level_with_a_failed_stream_fails_the_load_rule_with_the_count(
        pytester: pytest.Pytester, fault: str, message: str):
    # Streams 1-4 warm up, 5-8 are concurrency 1, 9-12 concurrency 4: the 10th fails.
    result = _gate(pytester, Knobs(stream_token_s=0.001), Knobs(stream_token_s=0.001, stream_fault=fault),
                   load=LOAD)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([f"*measuring fp8: http://127.0.0.1:*: load at concurrency 4: 1 of 4 streamed "
                                 f"requests failed (only complete requests count); the first: *{message}*"])


def test_complete_streams_pass_the_load_rule(pytester: pytest.Pytester):
    """The load faults' gate without a fault: what fails above is the fault alone."""
    result = _gate(pytester, Knobs(stream_token_s=0.001), Knobs(stream_token_s=0.001), load=LOAD)
    result.assert_outcomes(passed=1)


def test_an_error_that_quotes_the_authorization_header_is_shown_without_the_key(pytester: pytest.Pytester):
    result = _gate(pytester, Knobs(echo_authorization=True), Knobs())
    result.assert_outcomes(failed=PROBABILITY_RULES)
    result.stdout.fnmatch_lines(["*measuring bf16: bf16 at http://127.0.0.1:*: /v1/completions: HTTP 400: malformed "
                                 "request (headers: Authorization: Bearer [[]key blanked[]])*"])


def test_an_unset_candidate_key_variable_is_named_before_any_request(pytester: pytest.Pytester,
                                                                     monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FP8GATE_UNSET_KEY", raising=False)
    base = Knobs()
    result = _gate(pytester, base, Knobs(), cand_keys={"api_key_env": "FP8GATE_UNSET_KEY"})
    result.assert_outcomes(failed=PROBABILITY_RULES)
    result.stdout.fnmatch_lines([f"*measuring bf16: {pytester.path / 'thresholds.toml'}: "
                                 "candidates[[]0[]].api_key_env: the environment variable FP8GATE_UNSET_KEY is not "
                                 "set or empty; set it to the API key of fp8's endpoint*"])
    assert base.requests == []  # the baseline was not measured first


def test_a_redeploy_behind_a_cached_baseline_s_url_and_name_is_measured_afresh(pytester: pytest.Pytester,
                                                                              tmp_path: Path):
    cache = f"--fp8gate-baseline-cache={tmp_path / 'cache'}"
    base = Knobs(api_key=KEY)
    with FakeEndpoint(base) as base_url, FakeEndpoint(Knobs(model="served-fp8", api_key=KEY)) as cand_url:
        _config(pytester.path, _keyed(base_url), _keyed(cand_url, "served-fp8"))
        _run(pytester, cache).assert_outcomes(passed=PROBABILITY_RULES)
        restored = _run(pytester, cache)
        restored.assert_outcomes(passed=PROBABILITY_RULES)
        restored.stdout.fnmatch_lines(["*baseline bf16 from the cache*"])
        base.logprob_scale = 0.5  # other weights behind the same URL and served name
        stale = _run(pytester, cache)
    assert stale.ret != 0 and stale.parseoutcomes().get("failed", 0) >= 1
    stale.stdout.fnmatch_lines(["*baseline cache miss for bf16 (entry not reused: the endpoint answers otherwise "
                                "than when the entry was measured: the first chunk's real-token log-probs differ by "
                                "* nats on average, over the tolerance 0.001 *; was it redeployed behind the same URL "
                                "and name?); measuring*"])


CRASH = "import sys\nprint('ValueError: no such model', flush=True)\nsys.exit(3)\n"
NEVER_HEALTHY = "import time\nprint('loading forever', flush=True)\ntime.sleep(600)\n"


@pytest.mark.parametrize("script, health_timeout_s, message", [
    (CRASH, 30.0, "bf16: vllm serve exited with status 3 before it became healthy; last log lines: "
                  "ValueError: no such model"),
    (NEVER_HEALTHY, 1.0, "bf16: vllm serve not healthy after 1 s (health_timeout_s); last log lines: loading "
                         "forever"),
], ids=["exits", "never-healthy"])
def test_a_failed_start_leaves_no_log_file_and_no_process(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                         script: str, health_timeout_s: float, message: str):
    (tmp_path / "server.py").write_text(script)
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(server_process, "VLLM_CLI", (sys.executable, str(tmp_path / "server.py")))
    server = server_process.ManagedServer("bf16", ["serve", MODEL], max_logprobs=5)
    assert server.log_path.parent == temporary
    with pytest.raises(EndpointError) as error:
        server.wait_healthy(health_timeout_s)
    assert str(error.value) == message
    # Only lifecycle's registry is there: its watchdog's, for this whole process, removed when it ends.
    assert [p.name for p in temporary.iterdir() if not p.name.startswith("fp8gate-tracked-")] == []
    assert not psutil.pid_exists(server.process.pid) or psutil.Process(server.process.pid).status() == "zombie"
