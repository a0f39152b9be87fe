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

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import pytest

from . import DEFAULT_CONFIG_NAME, REQUIRE_GPU_ENV

if TYPE_CHECKING:
    from .config.spec import GateConfig
    from .face.session import GateSession

_GATE_PLUGIN = "fp8gate-gate"  # the hooks registered once the gate is asked for
_INI_KEYS = ("fp8gate_config", "fp8gate_require_gpu", "fp8gate_artifacts", "fp8gate_baseline_cache", "fp8gate_report",
             "fp8gate_allow_no_rules", "fp8gate_compile_cache")
_OPTION_DESTS = (*_INI_KEYS, "fp8gate_update_baseline", "fp8gate_request_deadline")


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
        "--fp8gate-request-deadline",
        metavar="SECONDS",
        help="Whole-request deadline of every served model's requests, streams included, over each model's "
        "request_deadline_s (default 600)",
    )
    parser.addini("fp8gate_config", "Thresholds TOML of the gate, relative to the ini file")
    parser.addini("fp8gate_require_gpu", "Error out instead of skipping the gate's gpu rule tests without a CUDA "
                  "device", type="bool")
    parser.addini("fp8gate_artifacts", "Directory for the gate's run artifacts, relative to the ini file")
    parser.addini("fp8gate_baseline_cache", "Baseline cache directory, relative to the ini file")
    parser.addini("fp8gate_compile_cache", "vLLM's cache root for the gate's engines, relative to the ini file")
    parser.addini("fp8gate_report", "Markdown report path, relative to the ini file")
    parser.addini("fp8gate_allow_no_rules", "Let a run select none of the thresholds file's rules", type="bool")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fp8gate: a rule of the FP8 deploy gate")
    if not _gate_asked_for(config):
        return
    from . import options
    from .config.loader import load_config
    from .errors import ConfigError
    from .face import refusals, report_hooks
    from .face.session import CONFIG_KEY

    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; the gate's rule tests skip without one "
                            "unless --fp8gate-require-gpu")
    settings = options.read_settings(config)
    config.stash[options.SETTINGS_KEY] = settings
    config.stash[CONFIG_KEY] = None
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
        config.stash[CONFIG_KEY] = gate
        refusals.check_not_distributed(config)
    refusals.check_toml_args(config, settings.config_path)


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
        from .face.session import CONFIG_KEY

        gate_config = pytestconfig.stash[CONFIG_KEY]
    if gate_config is None:
        pytest.skip("no fp8gate thresholds file (--fp8gate-config)")
    return gate_config


@pytest.fixture(scope="session")
def fp8gate(pytestconfig: pytest.Config, fp8gate_config: GateConfig,
            tmp_path_factory: pytest.TempPathFactory) -> GateSession:
    """The gate session: ``fp8gate.measurements.baseline()``, ``.candidate(name)``, ``.gate``."""
    from .face.session import GateSession
    from .options import SETTINGS_KEY

    artifacts = pytestconfig.stash[SETTINGS_KEY].artifacts or tmp_path_factory.mktemp("fp8gate-artifacts")
    artifacts.mkdir(parents=True, exist_ok=True)
    return GateSession(pytestconfig, fp8gate_config, artifacts)


class _Gate:
    """The hooks of a run that asked for the gate; each imports what it calls (already loaded by then)."""

    @staticmethod
    def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
        from .face.collect import ThresholdsFile
        from .face.session import CONFIG_KEY

        gate = parent.config.stash[CONFIG_KEY]
        if gate is not None and file_path == gate.path:
            return ThresholdsFile.from_parent(parent, path=file_path)
        return None

    @staticmethod
    def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
        from . import hardware
        from .face import refusals
        from .options import SETTINGS_KEY

        # Only the gate's own rule tests: the user's other gpu-marked tests are theirs to skip.
        # A skip mark (not pytest.skip in setup) reports the skip at the test's own location.
        gpu_rules = [item for item in items if refusals.is_rule(item) and item.get_closest_marker("gpu")]
        if not gpu_rules or config.stash[SETTINGS_KEY].require_gpu:
            return
        probe = hardware.probe_cuda()
        if not probe.names:
            skip = pytest.mark.skip(reason=f"no CUDA device visible ({probe.source})")
            for item in gpu_rules:
                item.add_marker(skip)

    @staticmethod
    def pytest_deselected(items: list[pytest.Item]) -> None:
        from .face import refusals

        if items:
            refusals.count_deselected(items[0].config, items)

    @staticmethod
    def pytest_collection_finish(session: pytest.Session) -> None:
        from .face import refusals
        from .face.cases import needs_of
        from .face.session import CONFIG_KEY, NEEDS_KEY
        from .judge.verdict import Case
        from .options import SETTINGS_KEY

        gate = session.config.stash[CONFIG_KEY]
        if gate is not None:
            refusals.check_selection(session, session.config.stash[SETTINGS_KEY], gate)
            # What each engine measures follows the rule tests left after -k/-m deselection that will run.
            cases = [cast(Case, item.callspec.params["case"]) for item in session.items
                     if refusals.is_rule(item) and not item.get_closest_marker("skip")]
            session.config.stash[NEEDS_KEY] = needs_of(cases)

    @staticmethod
    def pytest_runtest_call(item: pytest.Item) -> None:
        from .face import refusals

        refusals.record_call(item)

    @staticmethod
    @pytest.hookimpl(tryfirst=True)  # before fixtures, which may start an engine
    def pytest_runtest_setup(item: pytest.Item) -> None:
        from . import hardware
        from .face import refusals
        from .options import SETTINGS_KEY

        if not (refusals.is_rule(item) and item.get_closest_marker("gpu")) \
                or not item.config.stash[SETTINGS_KEY].require_gpu:
            return
        probe = hardware.probe_cuda()
        if not probe.names:
            pytest.fail(
                f"--fp8gate-require-gpu: no CUDA device visible ({probe.source}); "
                "a deploy gate must never pass by skipping",
                pytrace=False,
            )

    @staticmethod
    def pytest_report_header(config: pytest.Config) -> list[str]:
        from . import hardware, options
        from .engines import lifecycle
        from .face.session import CONFIG_KEY

        settings, gate = config.stash[options.SETTINGS_KEY], config.stash[CONFIG_KEY]
        if gate is None:
            lines = [f"fp8gate: no thresholds file (--fp8gate-config, or {DEFAULT_CONFIG_NAME} in rootdir)"]
        else:
            candidates = ", ".join(spec.name for spec in gate.candidates)
            lines = [f"fp8gate: {options.display_path(gate.path)}: {gate.baseline.name} vs {candidates}"]
        stale = lifecycle.stale_warning(settings.artifacts) if settings.artifacts else None
        if stale:
            lines.append(stale)
        # Probing may import torch (seconds), so only when the gate is in use.
        if gate is not None or settings.require_gpu:
            probe = hardware.probe_cuda()
            required = "; required" if settings.require_gpu else ""
            lines.append(f"fp8gate GPUs: {', '.join(probe.names) or 'none visible'} ({probe.source}{required})")
        return lines

    @staticmethod
    def pytest_sessionfinish(session: pytest.Session) -> None:
        from .face import refusals
        from .face.session import CONFIG_KEY
        from .options import SETTINGS_KEY

        gate = session.config.stash[CONFIG_KEY]
        if gate is not None:
            refusals.check_gpu_ran(session, session.config.stash[SETTINGS_KEY], gate)

    @staticmethod
    def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        from .face import refusals, report_hooks
        from .face.session import VERDICTS_KEY

        complaint = refusals.complaint(config)
        if complaint:
            terminalreporter.write_line(f"fp8gate: {complaint}", red=True, bold=True)
        verdicts: list[Any] = config.stash.get(VERDICTS_KEY, [])
        lines = (report_hooks.summary_lines(verdicts) if verdicts else []) + report_hooks.time_lines(config)
        if lines:  # under their own heading, never run into the last failure's report
            terminalreporter.write_sep("=", "fp8gate summary")
            for line in lines:
                terminalreporter.write_line(line)
