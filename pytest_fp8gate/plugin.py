"""pytest hooks and options of the FP8 deploy gate; the work happens in the modules they call.

Loading this module costs nothing: it imports only pytest and the standard library.
The gate's modules (and numpy) are imported once a run asks for the gate: a
thresholds file given or found in rootdir, a TOML file among the arguments, or one
of the gate's options, ini keys or environment flag set. Only then are the
collector, the session's hooks and the reports registered. A run that does not ask for
the gate meets one report-header line and two fixtures that skip.

PYTEST_DONT_REWRITE: this module holds no assert, and rewriting it would cost every
start where bytecode is not cached.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from . import DEFAULT_CONFIG_NAME, REQUIRE_GPU_ENV

if TYPE_CHECKING:
    from .config.spec import GateConfig
    from .face.session import GateSession

_GATE_PLUGIN = "fp8gate-gate"  # the hooks registered once the gate is asked for
_INI_KEYS = ("fp8gate_config", "fp8gate_require_gpu", "fp8gate_artifacts", "fp8gate_baseline_cache", "fp8gate_report",
             "fp8gate_allow_no_rules", "fp8gate_compile_cache", "fp8gate_cache_wait")
_OPTION_DESTS = (*_INI_KEYS, "fp8gate_update_baseline", "fp8gate_request_deadline", "fp8gate_candidate",
                 "fp8gate_baseline_only")
_JSON_REPORT_MISSING = ("--json-report needs pytest-json-report, which is not installed (pip install "
                        "'pytest-fp8gate[json]'); this run writes no JSON report")


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from .face import hookspecs  # pytest alone: the gate's modules load only once a run asks for it

    pluginmanager.add_hookspecs(hookspecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fp8gate", "FP8 deploy gate")
    group.addoption(
        "--fp8gate-config",
        metavar="PATH",
        help=f"Thresholds TOML of the gate (default: {DEFAULT_CONFIG_NAME} in rootdir, when present)",
    )
    group.addoption(
        "--fp8gate-require-gpu",
        action="store_true",
        help=f"Error out instead of skipping the gate's gpu rule tests when no CUDA device is visible "
        f"(also {REQUIRE_GPU_ENV}=1)",
    )
    group.addoption("--fp8gate-artifacts", metavar="DIR", help="Directory for the gate's run artifacts")
    group.addoption(
        "--fp8gate-baseline-cache",
        metavar="DIR",
        help="Reuse the baseline's measurements across runs from DIR, keyed by everything that changes them",
    )
    group.addoption(
        "--fp8gate-compile-cache",
        metavar="DIR",
        help="vLLM's cache root (VLLM_CACHE_ROOT: its torch.compile cache) for every engine and server the gate "
        "starts, so a later run skips compiling (default: vllm-cache in the baseline cache, when one is given)",
    )
    group.addoption(
        "--fp8gate-candidate",
        metavar="NAME",
        action="append",
        default=[],
        help="Judge only this candidate of the thresholds file (repeatable, or a comma list); the baseline is "
        "measured or restored as for the whole file",
    )
    group.addoption(
        "--fp8gate-baseline-only",
        action="store_true",
        help="Measure (or restore) the baseline into the baseline cache and judge no candidate: each rule test "
        "is skipped once the baseline is there (a CI matrix's first job)",
    )
    group.addoption(
        "--fp8gate-cache-wait",
        metavar="SECONDS",
        help="How long to wait for another run that is measuring the same baseline into the baseline cache, then "
        "restore its entry (default 7200; 0: measure this run's own at once, leaving the entry to that run)",
    )
    group.addoption(
        "--fp8gate-update-baseline",
        action="store_true",
        help="Measure the baseline again and replace its entry in the baseline cache",
    )
    group.addoption(
        "--fp8gate-report",
        metavar="PATH",
        help="Write a markdown report of the verdicts to PATH, its plots next to it "
        "(also appended to $GITHUB_STEP_SUMMARY when set)",
    )
    group.addoption(
        "--fp8gate-allow-no-rules",
        action="store_true",
        help="Let a run with a thresholds file select none of its rules (by default that is an error)",
    )
    group.addoption(
        "--fp8gate-progress-interval",
        metavar="SECONDS",
        default=None,
        help="Print each long pass's progress (how far, rate, time left) every SECONDS; 0 turns it off "
        "(default: 30)",
    )
    group.addoption(
        "--fp8gate-request-deadline",
        metavar="SECONDS",
        help="Whole-request deadline of every served model's requests, streams included, over each model's "
        "request_deadline_s (default 600)",
    )
    if not _json_report_installed():
        # Its options stand in for the optional plugin's, so a run that asks for the JSON report still runs
        # and is told once what is missing (pytest_configure) instead of stopping at an unknown option.
        group.addoption("--json-report", action="store_true", help=f"(fp8gate) {_JSON_REPORT_MISSING}")
        group.addoption("--json-report-file", metavar="PATH", help="(fp8gate) see --json-report")
    parser.addini("fp8gate_config", "Thresholds TOML of the gate, relative to the ini file")
    parser.addini("fp8gate_require_gpu", "Error out instead of skipping the gate's gpu rule tests without a CUDA "
                  "device", type="bool")
    parser.addini("fp8gate_artifacts", "Directory for the gate's run artifacts, relative to the ini file")
    parser.addini("fp8gate_baseline_cache", "Baseline cache directory, relative to the ini file")
    parser.addini("fp8gate_cache_wait", "Seconds to wait for another run measuring the same baseline into the "
                  "baseline cache (0: measure this run's own)")
    parser.addini("fp8gate_compile_cache", "vLLM's cache root for the gate's engines, relative to the ini file")
    parser.addini("fp8gate_report", "Markdown report path, relative to the ini file")
    parser.addini("fp8gate_allow_no_rules", "Let a run select none of the thresholds file's rules", type="bool")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fp8gate: a rule of the FP8 deploy gate")
    if config.getoption("json_report", False) and not _json_report_installed():
        config.issue_config_time_warning(pytest.PytestConfigWarning(f"fp8gate: {_JSON_REPORT_MISSING}"), stacklevel=2)
    if not _gate_asked_for(config):
        return
    from . import options
    from .config.loader import load_config
    from .errors import ConfigError
    from .face import refusals, report_hooks
    from .face.session import STATE_KEY, RunState

    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; the gate's rule tests skip without one "
                            "unless --fp8gate-require-gpu")
    settings = options.read_settings(config)
    state = config.stash[STATE_KEY] = RunState(settings)
    config.pluginmanager.register(_Gate(), _GATE_PLUGIN)
    config.pluginmanager.register(report_hooks.JsonReportMetadata(config), "fp8gate-json-report")
    config.pluginmanager.register(report_hooks.SessionReport(), "fp8gate-report")
    # `pytest --help` must keep working while the thresholds file is broken.
    if config.getoption("help", False):
        return
    if settings.config_path is not None:
        try:
            gate = load_config(options.display_path(settings.config_path))
        except ConfigError as err:
            raise pytest.UsageError(str(err)) from None
        if settings.request_deadline_s is not None:
            from .config.spec import with_request_deadline

            gate = with_request_deadline(gate, settings.request_deadline_s)
        if settings.candidates:
            from .config.spec import with_candidates

            try:
                gate = with_candidates(gate, settings.candidates)
            except ValueError as err:
                known = ", ".join(spec.name for spec in gate.candidates)
                raise pytest.UsageError(f"--fp8gate-candidate {err}: not a candidate of "
                                        f"{options.display_path(gate.path)} (its candidates: {known})") from None
        state.config = gate
        refusals.check_not_distributed(config)
    refusals.check_toml_args(config, settings.config_path)


def _json_report_installed() -> bool:
    """Whether pytest-json-report (the `json` extra) can be loaded."""
    return importlib.util.find_spec("pytest_jsonreport") is not None


def _gate_asked_for(config: pytest.Config) -> bool:
    """Whether anything in this run names the gate; cheap, so that runs without it import nothing."""
    if any(config.getoption(name) for name in _OPTION_DESTS) or any(config.getini(name) for name in _INI_KEYS):
        return True
    if REQUIRE_GPU_ENV in os.environ or (config.rootpath / DEFAULT_CONFIG_NAME).is_file():
        return True
    return any(arg.split("::")[0].endswith(".toml") for arg in config.args)


def pytest_report_header(config: pytest.Config) -> list[str]:
    if config.pluginmanager.has_plugin(_GATE_PLUGIN):
        return []  # the gate's own header
    return [f"fp8gate: no thresholds file (--fp8gate-config, or {DEFAULT_CONFIG_NAME} in rootdir)"]


@pytest.fixture(scope="session")
def fp8gate_config(pytestconfig: pytest.Config) -> GateConfig:
    """The loaded thresholds file (skips when the session has none)."""
    gate_config = None
    if pytestconfig.pluginmanager.has_plugin(_GATE_PLUGIN):
        from .face.session import run_state

        gate_config = run_state(pytestconfig).config
    if gate_config is None:
        pytest.skip("no fp8gate thresholds file (--fp8gate-config)")
    return gate_config


@pytest.fixture(scope="session")
def fp8gate(pytestconfig: pytest.Config, fp8gate_config: GateConfig,
            tmp_path_factory: pytest.TempPathFactory) -> GateSession:
    """The gate session: ``fp8gate.measurements.baseline()``, ``.candidate(name)``, ``.gate``."""
    from .face.session import GateSession, run_state

    artifacts = run_state(pytestconfig).settings.artifacts or tmp_path_factory.mktemp("fp8gate-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    return GateSession(pytestconfig, fp8gate_config, artifacts)


class _Gate:
    """The hooks of a run that asked for the gate, each a delegation with its run state (face/session.py)
    to face/selection.py, refusals.py or report_hooks.py; each imports what it calls (already loaded by then)."""

    @staticmethod
    def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        from .face import selection
        from .face.session import run_state

        return selection.collect_file(run_state(parent.config), file_path, parent)

    @staticmethod
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        from .face import selection
        from .face.session import run_state

        selection.skip_gpu_rules_without_gpu(run_state(config), items)

    @staticmethod
    def pytest_deselected(items: list[pytest.Item]) -> None:
        from .face import refusals
        from .face.session import run_state

        if items:
            refusals.count_deselected(run_state(items[0].config).tally, items)

    @staticmethod
    def pytest_collection_finish(session: pytest.Session) -> None:
        from .face import selection
        from .face.session import run_state

        selection.finish_collection(run_state(session.config), session)

    @staticmethod
    def pytest_runtest_call(item: pytest.Item) -> None:
        from .face import refusals
        from .face.session import run_state

        refusals.record_call(run_state(item.config).tally, item)

    @staticmethod
    @pytest.hookimpl(tryfirst=True)  # before fixtures, which may start an engine
    def pytest_runtest_setup(item: pytest.Item) -> None:
        from .face import selection
        from .face.session import run_state

        selection.require_gpu(run_state(item.config), item)

    @staticmethod
    def pytest_report_header(config: pytest.Config) -> list[str]:
        from .face.session import run_state

        return run_state(config).header_lines()

    @staticmethod
    def pytest_sessionfinish(session: pytest.Session) -> None:
        from .face import refusals
        from .face.session import run_state

        refusals.finish(run_state(session.config), session)

    @staticmethod
    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        from .face import report_hooks
        from .face.session import run_state

        report_hooks.terminal_summary(terminalreporter, run_state(config))
