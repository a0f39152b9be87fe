from __future__ import annotations

import importlib.util
import sys

import pytest

from fakes import MODELS, fake_engine_class, thresholds_text, write_gate
from pytest_fp8gate import hardware, plugin
from test_selection import UseEngine

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

VALID = thresholds_text("[speed]")

GPU_TEST = """
import pytest

@pytest.mark.gpu
def test_needs_gpu():
    pass

def test_plain():
    pass
"""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FP8GATE_REQUIRE_GPU", raising=False)


@pytest.fixture
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def test_help_lists_options_and_ini_keys(pytester: pytest.Pytester):
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "FP8 deploy gate:",
            "*--fp8gate-config=PATH*",
            "*--fp8gate-require-gpu*",
            "*--fp8gate-artifacts=DIR*",
            "*fp8gate_config (string)*",
            "*fp8gate_require_gpu (bool)*",
            "*fp8gate_artifacts (string)*",
        ]
    )
    assert result.ret == pytest.ExitCode.OK


def test_help_works_with_a_broken_thresholds_file(pytester: pytest.Pytester):
    pytester.makefile(".toml", thresholds="[baseline\n")
    result = pytester.runpytest("--help")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["*--fp8gate-config=PATH*"])


def test_markers_are_registered(pytester: pytest.Pytester):
    pytester.makefile(".toml", thresholds=VALID)
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.fp8gate: a rule of the FP8 deploy gate",
            "@pytest.mark.gpu: needs a CUDA GPU; the gate's rule tests skip without one unless --fp8gate-require-gpu",
        ]
    )


def test_without_a_gate_the_gpu_marker_is_the_users(pytester: pytest.Pytester):
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.fp8gate: a rule of the FP8 deploy gate"])
    assert "@pytest.mark.gpu" not in result.stdout.str()


def test_markers_pass_strict_markers(pytester: pytest.Pytester, no_gpu):
    pytester.makefile(".toml", thresholds=VALID)
    pytester.makepyfile(GPU_TEST)
    pytester.runpytest("--strict-markers").assert_outcomes(passed=2, skipped=1)


def test_only_the_gates_gpu_tests_skip_without_gpu(pytester: pytest.Pytester, no_gpu):
    pytester.makefile(".toml", thresholds=VALID)
    pytester.makepyfile(test_gpu=GPU_TEST)
    result = pytester.runpytest("-rs", "-v")
    result.assert_outcomes(passed=2, skipped=1)
    # The user's gpu test runs; the gate's rule skips, reported at the rule, not inside the plugin.
    result.stdout.fnmatch_lines(["test_gpu.py::test_needs_gpu PASSED*",
                                 "thresholds.toml::test_decode_speed_near_ceiling[[]fp8[]] SKIPPED*",
                                 "SKIPPED [[]1[]] *suite.py: no CUDA device visible (faked by the test)"])
    assert result.ret == pytest.ExitCode.OK


def test_without_a_gate_the_users_gpu_tests_run(pytester: pytest.Pytester, no_gpu):
    pytester.makeini("[pytest]\nmarkers = gpu: theirs\n")
    pytester.makepyfile(GPU_TEST)
    pytester.runpytest("--strict-markers").assert_outcomes(passed=2)


def test_gpu_test_runs_with_gpu(pytester: pytest.Pytester, fake_gpus):
    fake_gpus("NVIDIA H200")
    pytester.makeini("[pytest]\nmarkers = gpu: theirs\n")
    pytester.makepyfile(GPU_TEST)
    pytester.runpytest("--fp8gate-require-gpu").assert_outcomes(passed=2)


REQUIRE_GPU_WAYS = {
    "option": (["--fp8gate-require-gpu"], {}, None),
    "env": ([], {"FP8GATE_REQUIRE_GPU": "1"}, None),
    "env-true": ([], {"FP8GATE_REQUIRE_GPU": "true"}, None),
    "ini": ([], {}, "[pytest]\nfp8gate_require_gpu = true\n"),
}


@pytest.mark.parametrize("args, env, ini", REQUIRE_GPU_WAYS.values(), ids=REQUIRE_GPU_WAYS.keys())
def test_require_gpu_turns_the_skip_into_an_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, no_gpu, args, env, ini
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if ini:
        pytester.makeini(ini)
    pytester.makefile(".toml", thresholds=VALID)
    pytester.makepyfile(GPU_TEST)
    result = pytester.runpytest(*args)
    # Only the gate's rule: the user's gpu test is theirs, and runs.
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at setup of test_decode_speed_near_ceiling[[]fp8[]]*",
            "--fp8gate-require-gpu: no CUDA device visible (faked by the test); "
            "a deploy gate must never pass by skipping",
        ]
    )
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_require_gpu_env_zero_means_off(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, no_gpu):
    monkeypatch.setenv("FP8GATE_REQUIRE_GPU", "0")
    pytester.makefile(".toml", thresholds=VALID)
    pytester.makepyfile(GPU_TEST)
    pytester.runpytest().assert_outcomes(passed=2, skipped=1)


def test_require_gpu_env_garbage_is_a_usage_error(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FP8GATE_REQUIRE_GPU", "maybe")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["ERROR: FP8GATE_REQUIRE_GPU='maybe': expected 1 or 0 (or true/false)"])


INVALID_TOML = "[baseline\nname = 1\n"


def toml_error(text: str) -> str:
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        return str(err)
    raise AssertionError("valid TOML")


BAD_THRESHOLDS = {
    "unknown key": (
        VALID + '[[candidates]]\nname = "b"\nmodel = "org/b"\n[candidates.engine]\ntensor_paralel_size = 2\n',
        "thresholds.toml: candidates[1].engine.tensor_paralel_size: unknown key; did you mean 'tensor_parallel_size'?",
    ),
    "wrong type": (
        VALID.replace("[speed]", '[speed]\niters = "10"'),
        "thresholds.toml: speed.iters: expected an integer >= 1, got string '10'",
    ),
    "out of range": (
        VALID.replace("[speed]", "[speed]\nmin_fraction_of_ceiling = 80"),
        "thresholds.toml: speed.min_fraction_of_ceiling: expected a number in (0, 1], got 80; a fraction, not a "
        "percent: did you mean 0.8?",
    ),
    "empty candidates": (
        thresholds_text("[speed]", candidate=None, head="candidates = []"),
        "thresholds.toml: candidates: expected at least one [[candidates]] table",
    ),
    "duplicate names": (
        VALID + '[[candidates]]\nname = "fp8"\nmodel = "org/b"\n',
        "thresholds.toml: candidates[1].name: duplicate name 'fp8' (also used by candidates[0])",
    ),
    "invalid TOML": (INVALID_TOML, f"thresholds.toml: invalid TOML: {toml_error(INVALID_TOML)}"),
}


@pytest.mark.parametrize("text, message", BAD_THRESHOLDS.values(), ids=BAD_THRESHOLDS.keys())
def test_bad_thresholds_are_a_usage_error_without_traceback(pytester: pytest.Pytester, text: str, message: str):
    pytester.makefile(".toml", thresholds=text)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == f"ERROR: {message}"
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


def test_missing_local_model_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makefile(".toml", thresholds=VALID.replace('name = "fp8"', 'name = "fp8"\nmodel = "./ckpt/fp8"'))
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    local = pytester.path.resolve() / "ckpt" / "fp8"
    assert result.stderr.lines[0] == f"ERROR: thresholds.toml: candidates[0].model: local path not found: {local}"


def test_missing_config_given_on_the_command_line(pytester: pytest.Pytester):
    result = pytester.runpytest("--fp8gate-config", "gate/missing.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == "ERROR: gate/missing.toml: file not found"


STASH_PROBE = """
from pytest_fp8gate.face.session import STATE_KEY

def test_stash(request):
    state = request.config.stash.get(STATE_KEY, None)  # a run without the gate stashes nothing
    gate, settings = (None, None) if state is None else (state.config, state.settings)
    print("GATE", None if gate is None else (gate.path.name, gate.baseline.name, gate.candidates[0].name))
    print("ARTIFACTS", None if settings is None else settings.artifacts)
"""


def test_config_found_in_rootdir_is_stashed(pytester: pytest.Pytester, no_gpu):
    pytester.makefile(".toml", thresholds=VALID)
    pytester.makepyfile(STASH_PROBE)
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(["*GATE ('thresholds.toml', 'bf16', 'fp8')", "ARTIFACTS None"])
    # The file in rootdir is also collected: its rule test is marked gpu and skips here.
    result.assert_outcomes(passed=1, skipped=1)


def test_config_and_artifacts_from_the_command_line(pytester: pytest.Pytester, no_gpu):
    (pytester.path / "gates").mkdir()
    (pytester.path / "gates" / "llama.toml").write_text(VALID)
    pytester.makepyfile(STASH_PROBE)
    result = pytester.runpytest("-s", "--fp8gate-config", "gates/llama.toml", "--fp8gate-artifacts", "out")
    artifacts = pytester.path.resolve() / "out"
    result.stdout.fnmatch_lines(["*GATE ('llama.toml', 'bf16', 'fp8')", f"ARTIFACTS {artifacts}"])


def test_ini_paths_are_relative_to_the_ini_file(pytester: pytest.Pytester, no_gpu):
    (pytester.path / "ci").mkdir()
    (pytester.path / "ci" / "gate.toml").write_text(VALID)
    (pytester.path / "ci" / "pytest.ini").write_text(
        "[pytest]\nfp8gate_config = gate.toml\nfp8gate_artifacts = ../artifacts\n"
    )
    pytester.makepyfile(STASH_PROBE)
    result = pytester.runpytest("-s", "-c", "ci/pytest.ini", "--rootdir", str(pytester.path))
    artifacts = pytester.path.resolve() / "artifacts"
    result.stdout.fnmatch_lines(["*GATE ('gate.toml', 'bf16', 'fp8')", f"ARTIFACTS {artifacts}"])


def test_no_config_means_nothing_is_stashed(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    def must_not_probe():
        raise AssertionError("GPU probe without a gate")

    monkeypatch.setattr(hardware, "probe_cuda", must_not_probe)
    pytester.makepyfile(STASH_PROBE)
    result = pytester.runpytest("-s")
    result.stdout.fnmatch_lines(
        ["fp8gate: no thresholds file (--fp8gate-config, or thresholds.toml in rootdir)", "*GATE None"]
    )
    result.assert_outcomes(passed=1)


def test_report_header(pytester: pytest.Pytester, fake_gpus):
    fake_gpus("NVIDIA L40S")
    pytester.makefile(".toml", thresholds=VALID)
    result = pytester.runpytest("--fp8gate-require-gpu")
    result.stdout.fnmatch_lines(
        [
            "fp8gate: thresholds.toml: bf16 vs fp8",
            "fp8gate GPUs: NVIDIA L40S (faked by the test; required)",
        ]
    )


@pytest.mark.parametrize("speed, line", [
    ('gpu = "H100"', "fp8gate speed.gpu: the H100 SXM (3,350 GB/s, 80 GiB); for the H100 PCIe (2,000 GB/s) write "
                     '"H100 PCIe" or the H100 NVL (3,900 GB/s) write "H100 NVL"'),
    ('gpu = "MI300X"\nbandwidth_gbps = 5300', "fp8gate speed.gpu: MI300X at 5,300 GB/s (speed.bandwidth_gbps)"),
])
def test_the_header_says_which_card_and_bandwidth_speed_gpu_means(pytester: pytest.Pytester, fake_gpus, speed: str,
                                                                   line: str):
    fake_gpus("NVIDIA L40S")
    pytester.makefile(".toml", thresholds=thresholds_text(f"[speed]\n{speed}"))
    result = pytester.runpytest("--fp8gate-require-gpu")
    assert line in result.stdout.str().splitlines()


LOADED_PROBE = """
import sys

def test_loaded():
    package = sorted(name for name in sys.modules if name.startswith("pytest_fp8gate"))
    heavy = sorted(name for name in ("numpy", "torch", "vllm", "lm_eval") if name in sys.modules)
    print("LOADED", package, heavy)
"""


def test_a_run_without_the_gate_imports_only_the_hook_modules(pytester: pytest.Pytester):
    # A fresh interpreter (this one has the whole package loaded); the plugin and the gate's hook
    # specifications (face/hookspecs.py, pytest alone) must be among them.
    pytester.makepyfile(LOADED_PROBE)
    result = pytester.runpytest_subprocess("-s")
    assert ("LOADED ['pytest_fp8gate', 'pytest_fp8gate.face', 'pytest_fp8gate.face.hookspecs', "
            "'pytest_fp8gate.plugin'] []") in result.stdout.str()
    result.assert_outcomes(passed=1)


def test_plugin_can_be_disabled(pytester: pytest.Pytester):
    pytester.makefile(".toml", thresholds="[baseline\n")
    pytester.makepyfile("def test_x(): pass")
    pytester.runpytest("-p", "no:fp8gate").assert_outcomes(passed=1)


def test_real_probe_is_consistent():
    # Whatever this machine has, the public list and the probe agree.
    probe = hardware.probe_cuda()
    assert hardware.cuda_device_names() == list(probe.names)
    assert probe.source


def test_version_is_the_installed_distribution_s() -> None:
    import importlib.metadata

    import pytest_fp8gate

    assert pytest_fp8gate.__version__ == importlib.metadata.version("pytest-fp8gate")


# The refusal is tested against pytest-xdist itself (the dev extra installs it). Without it, this
# conftest declares its options instead (-n is its alias for --numprocesses, a short option only xdist may add).
XDIST = ["-p", "xdist"] if importlib.util.find_spec("xdist") else []
XDIST_OPTIONS = """
def pytest_addoption(parser):
    group = parser.getgroup("xdist")
    group.addoption("--numprocesses", dest="numprocesses", type=int)
    group.addoption("--dist", dest="dist", default="no")
"""
# A process marked as a worker the way xdist's worker is: a gate run in a worker is refused too.
XDIST_WORKER = """
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    config.workerinput = {"workerid": "gw1"}
"""
XDIST_REFUSAL = ("ERROR: fp8gate cannot run under pytest-xdist ({}): every worker would start its own "
                 "baseline engine on the same GPU; run the gate without -n")


def _distributed(pytester: pytest.Pytester) -> list[str]:
    """The arguments that load pytest-xdist, or its options declared in a conftest where it is not installed."""
    if not XDIST:
        pytester.makeconftest(XDIST_OPTIONS)
    return XDIST


@pytest.mark.parametrize("args, how", [
    (["--numprocesses", "2"], "-n 2"),
    (["--dist", "loadfile"], "--dist loadfile"),
    (None, "worker gw1"),
], ids=["numprocesses", "dist", "worker"])
def test_xdist_is_refused_with_a_thresholds_file(pytester: pytest.Pytester, args: list[str] | None, how: str):
    if args is None:
        pytester.makeconftest(XDIST_WORKER)
        args = []
    else:
        args = _distributed(pytester) + args
    pytester.makefile(".toml", thresholds=VALID)
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == XDIST_REFUSAL.format(how)
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize("thresholds, args", [(None, ["--numprocesses", "2"]), (VALID, ["--numprocesses", "0"])],
                         ids=["no-thresholds-file", "n-0"])
def test_xdist_without_the_gate_or_without_workers_is_fine(pytester: pytest.Pytester, no_gpu,
                                                           thresholds: str | None, args: list[str]):
    if thresholds:
        pytester.makefile(".toml", thresholds=thresholds)
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(*_distributed(pytester), *args)
    result.assert_outcomes(passed=1, skipped=1 if thresholds else 0)


def test_json_report_without_its_plugin_gates_and_says_once_what_is_missing(pytester: pytest.Pytester, no_gpu,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(plugin, "_json_report_installed", lambda: False)  # pytest-json-report, the json extra
    write_gate(pytester.path, task=False)
    result = pytester.runpytest("thresholds.toml", "-k", "kl_within", "--json-report", "--json-report-file=r.json",
                                plugins=[UseEngine(fake_engine_class(MODELS))])
    result.assert_outcomes(passed=1, failed=1)
    assert result.stdout.str().count("--json-report needs pytest-json-report, which is not installed") == 1
    assert not (pytester.path / "r.json").exists()
