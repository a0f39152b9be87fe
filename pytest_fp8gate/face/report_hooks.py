"""After the run: the terminal summary, each rule's numbers in the JSON and JUnit reports, the markdown report."""

from __future__ import annotations

import os
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

from .. import timing
from ..judge.verdict import Case, Verdict
from ..options import display_path
from ..report import markdown_report
from .session import VERDICT_KEY, GateSession, RunState, run_state


def summary_lines(verdicts: list[Verdict]) -> list[str]:
    header = ("rule", "candidate", "task", "measured", "threshold", "margin", "result")
    rows = [(v.outcome.rule, v.case.candidate, v.case.task or "-", f"{v.outcome.measured:.6g}",
             f"{v.outcome.limit:.6g}", f"{v.outcome.margin:+.6g}", "pass" if v.passed else "FAIL")
            for v in verdicts]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def junit_properties(verdict: Verdict) -> list[tuple[str, object]]:
    """A rule's numbers as JUnit ``<property>`` pairs (CI systems that read JUnit, not JSON)."""
    outcome = verdict.outcome
    properties: list[tuple[str, object]] = [
        ("fp8gate.rule", outcome.rule), ("fp8gate.candidate", verdict.case.candidate),
        ("fp8gate.task", verdict.case.task or ""), ("fp8gate.passed", outcome.passed),
        ("fp8gate.measured", outcome.measured), ("fp8gate.noise_floor", markdown_report.noise_floor_text(verdict)),
        ("fp8gate.threshold", outcome.limit), ("fp8gate.margin", outcome.margin),
    ]
    return properties + [(f"fp8gate.row.{label}", value) for label, value in outcome.rows]


class JsonReportMetadata:
    """Attaches each rule's numbers to its test's entry, and where the run's time went to the
    report's top level (``fp8gate.time``), when pytest-json-report runs."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @staticmethod
    @pytest.hookimpl(optionalhook=True)  # the hook exists only while --json-report is active
    def pytest_json_runtest_metadata(item: pytest.Item, call: pytest.CallInfo[Any]) -> dict[str, Any]:
        verdict = item.stash.get(VERDICT_KEY, None)
        if call.when != "call" or verdict is None:
            return {}
        return {"fp8gate": verdict.as_dict()}

    @pytest.hookimpl(optionalhook=True)
    def pytest_json_modifyreport(self, json_report: dict[str, Any]) -> None:
        gate_session = run_state(self.config).session
        if gate_session is not None:
            json_report["fp8gate"] = {"time": gate_session.measurements.time.as_dict()}


def time_lines(gate_session: GateSession | None) -> list[str]:
    """Where the gate session's wall time went, a line per model (none without a gate session)."""
    if gate_session is None:
        return []
    return [f"fp8gate time: {line}" for line in timing.summary_lines(gate_session.measurements.time)]


def terminal_summary(terminalreporter: pytest.TerminalReporter, state: RunState) -> None:
    """What stopped the run from gating, the verdicts' table and the time lines, under one heading."""
    if state.tally.complaint:
        terminalreporter.write_line(f"fp8gate: {state.tally.complaint}", red=True, bold=True)
    lines = (summary_lines(state.verdicts) if state.verdicts else []) + time_lines(state.session)
    if lines:  # under their own heading, never run into the last failure's report
        terminalreporter.write_sep("=", "fp8gate summary")
        for line in lines:
            terminalreporter.write_line(line)


def report_data(session: GateSession, verdicts: list[Verdict],
                unjudged: list[tuple[Case, str]]) -> markdown_report.ReportData:
    """The session's verdicts and measurements, as the markdown report reads them."""
    measurements = session.measurements
    config = measurements.config
    record = measurements.baseline_record
    candidates = measurements.measured_candidates()
    models = {config.baseline.name: measurements.fingerprint(config.baseline)} if record else {}
    models.update({name: measurements.fingerprint(result.spec) for name, result in candidates.items()})
    cached = [dict(run, label=f"{run['label']} (cache entry)") for run in record.engine_runs] \
        if record is not None and record.cached else []
    runs = cached + measurements.engine_runs
    provenance = dict(measurements.provenance(config.baseline), models=models, engine_runs=runs)
    return markdown_report.ReportData(config, verdicts, record, candidates, provenance, session.gate.comparisons,
                                      unjudged, measurements.time.as_dict())


class SessionReport:
    """Rule numbers into JUnit properties; at session end, the markdown report (never raising)."""

    def __init__(self) -> None:
        self.unjudged: list[tuple[Case, str]] = []
        self.written: list[Path] = []
        self.error: str | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[Any]) -> Generator[
            None, pytest.TestReport, pytest.TestReport]:
        verdict = item.stash.get(VERDICT_KEY, None)
        if call.when == "call" and verdict is not None:
            item.user_properties.extend(junit_properties(verdict))  # read when the report is built
        report = yield
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        if isinstance(case, Case) and verdict is None and (report.skipped or report.failed):
            self.unjudged.append((case, f"{'skipped' if report.skipped else 'error'}: {_reason(report)}"))
        return report

    @pytest.hookimpl(wrapper=True)  # around every plugin's: written before the JSON report, which holds its time
    def pytest_sessionfinish(self, session: pytest.Session) -> Generator[None, None, None]:
        self._write_report(session.config)
        yield

    def _write_report(self, config: pytest.Config) -> None:
        state = run_state(config)
        gate_session, path = state.session, state.settings.report
        if hasattr(config, "workerinput") or gate_session is None:
            return
        if path is None and not os.environ.get("GITHUB_STEP_SUMMARY"):
            return
        try:
            with gate_session.measurements.time.span(timing.GATE, "reporting"):  # up to the table's writing
                data = report_data(gate_session, state.verdicts, self.unjudged)
                self.written = markdown_report.write(data, path)
        except Exception as err:  # a report problem must not hide the verdicts or change the exit status
            self.error = f"{type(err).__name__}: {err}"

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if self.written:
            terminalreporter.write_line("fp8gate report: " + ", ".join(str(display_path(p)) for p in self.written))
        if self.error:
            terminalreporter.write_line(f"fp8gate: the markdown report was not written: {self.error}", yellow=True)


def _reason(report: pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    text = str(getattr(report, "longreprtext", "") or longrepr)
    return text.strip().splitlines()[0] if text.strip() else "no message"
