"""pytest hooks of the FP8 deploy gate; the work happens in the modules they call."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest

from . import hardware, lifecycle, options, refusals, report_hooks, session
from .cases import needs_of
from .collect import ThresholdsFile
from .options import SETTINGS_KEY
from .session import CONFIG_KEY, NEEDS_KEY, VERDICTS_KEY
from .thresholds import ConfigError, load_config
from .verdict import Case


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one unless --fp8gate-require-gpu")
    config.addinivalue_line("markers", "fp8gate: a rule of the FP8 deploy gate")
    settings = options.read_settings(config)
    config.stash[SETTINGS_KEY] = settings
    config.stash[CONFIG_KEY] = None
    config.pluginmanager.register(session, "fp8gate-session")
    config.pluginmanager.register(report_hooks.JsonReportMetadata(), "fp8gate-json-report")
    config.pluginmanager.register(report_hooks.SessionReport(), "fp8gate-report")
    # `pytest --help` must keep working while the thresholds file is broken.
    if config.getoption("help", False):
        return
    if settings.config_path is not None:
        try:
            config.stash[CONFIG_KEY] = load_config(options.display_path(settings.config_path))
        except ConfigError as err:
            raise pytest.UsageError(str(err)) from None
        refusals.check_not_distributed(config)
    refusals.check_toml_args(config, settings.config_path)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    gate = parent.config.stash.get(CONFIG_KEY, None)
    if gate is not None and file_path == gate.path:
        return ThresholdsFile.from_parent(parent, path=file_path)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_items_without_gpu(config, items)


def pytest_deselected(items: list[pytest.Item]) -> None:
    if items:
        refusals.count_deselected(items[0].config, items)


def pytest_collection_finish(session: pytest.Session) -> None:
    gate = session.config.stash.get(CONFIG_KEY, None)
    if gate is not None:
        refusals.check_selection(session, session.config.stash[SETTINGS_KEY], gate)
        # What each engine measures follows the rule tests left after -k/-m deselection that will run.
        cases = [cast(Case, item.callspec.params["case"]) for item in session.items
                 if refusals.is_rule(item) and not item.get_closest_marker("skip")]
        session.config.stash[NEEDS_KEY] = needs_of(cases)


def pytest_runtest_call(item: pytest.Item) -> None:
    refusals.record_call(item)


def _skip_gpu_items_without_gpu(config: pytest.Config, items: list[pytest.Item]) -> None:
    # A skip mark (not pytest.skip in setup) reports the skip at the test's own location.
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items or config.stash[SETTINGS_KEY].require_gpu:
        return
    probe = hardware.probe_cuda()
    if not probe.names:
        skip = pytest.mark.skip(reason=f"no CUDA device visible ({probe.source})")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # before fixtures, which may start an engine
def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None or not item.config.stash[SETTINGS_KEY].require_gpu:
        return
    probe = hardware.probe_cuda()
    if not probe.names:
        pytest.fail(
            f"--fp8gate-require-gpu: no CUDA device visible ({probe.source}); "
            "a deploy gate must never pass by skipping",
            pytrace=False,
        )


def pytest_report_header(config: pytest.Config) -> list[str]:
    settings, gate = config.stash[SETTINGS_KEY], config.stash[CONFIG_KEY]
    if gate is None:
        lines = [f"fp8gate: no thresholds file (--fp8gate-config, or {options.DEFAULT_CONFIG_NAME} in rootdir)"]
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


def pytest_sessionfinish(session: pytest.Session) -> None:
    gate = session.config.stash.get(CONFIG_KEY, None)
    if gate is not None:
        refusals.check_gpu_ran(session, session.config.stash[SETTINGS_KEY], gate)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    complaint = refusals.complaint(config)
    if complaint:
        terminalreporter.write_line(f"fp8gate: {complaint}", red=True, bold=True)
    verdicts = config.stash.get(VERDICTS_KEY, [])
    if verdicts:
        terminalreporter.write_sep("=", "fp8gate summary")
        for line in report_hooks.summary_lines(verdicts):
            terminalreporter.write_line(line)
