"""The gate's session: the run state (one stash key) and the GateSession (plugin.py's fixtures hand it to tests)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .. import DEFAULT_CONFIG_NAME, gpu_bandwidths, hardware, timing
from ..config.spec import GateConfig, ModelSpec
from ..engines import lifecycle
from ..engines.backend import EngineChoice
from ..engines.base import Engine
from ..errors import Fp8GateError
from ..judge.gate import Gate
from ..judge.verdict import Case, Verdict
from ..options import Settings, display_path
from ..run.measure import Measurements
from ..run.record import Needs

VERDICT_KEY = pytest.StashKey[Verdict]()  # on each rule item, for the JSON report


@dataclass
class RuleTally:
    """The run's rule tests as the refusals count them (refusals.py)."""

    deselected: int = 0
    gpu_rules: set[str] = field(default_factory=set)  # node ids of the selected rules marked gpu
    ran_on_gpu: int = 0
    complaint: str | None = None  # shown in the terminal summary


@dataclass
class RunState:
    """What one pytest run that asked for the gate keeps, under one stash key (STATE_KEY), as syrupy keeps
    its SnapshotSession: plugin.py's hooks hand it to selection.py and refusals.py."""

    settings: Settings
    config: GateConfig | None = None  # the loaded thresholds, None without a file
    needs: dict[str, Needs] = field(default_factory=dict)  # what each engine measures, from the selected rules
    cases: list[Case] = field(default_factory=list)  # the selected rule cases that will run
    tally: RuleTally = field(default_factory=RuleTally)
    verdicts: list[Verdict] = field(default_factory=list)
    session: GateSession | None = None  # opened by the fp8gate fixture; the reports read it at session end

    def header_lines(self) -> list[str]:
        settings, gate = self.settings, self.config
        if gate is None:
            lines = [f"fp8gate: no thresholds file (--fp8gate-config, or {DEFAULT_CONFIG_NAME} in rootdir)"]
        else:
            candidates = ", ".join(spec.name for spec in gate.candidates)
            if settings.baseline_only:
                candidates += " (--fp8gate-baseline-only: none judged)"
            elif settings.candidates:
                candidates += " (selected by --fp8gate-candidate)"
            lines = [f"fp8gate: {display_path(gate.path)}: {gate.baseline.name} vs {candidates}"]
            speed = gate.speed
            if speed is not None and speed.bandwidth_gbps:
                lines.append(f"fp8gate speed.gpu: {speed.gpu} at {speed.bandwidth_gbps:,g} GB/s (speed.bandwidth_gbps)")
            elif speed is not None and speed.gpu != "auto":  # the table's card: a family name means one variant
                lines.append(f"fp8gate speed.gpu: {gpu_bandwidths.describe_match(speed.gpu)}")
        stale = lifecycle.stale_warning(settings.artifacts) if settings.artifacts else None
        if stale:
            lines.append(stale)
        # Probing may import torch (seconds), so only when the gate is in use.
        if gate is not None or settings.require_gpu:
            probe = hardware.probe_cuda()
            required = "; required" if settings.require_gpu else ""
            lines.append(f"fp8gate GPUs: {', '.join(probe.names) or 'none visible'} ({probe.source}{required})")
        return lines


STATE_KEY = pytest.StashKey[RunState]()


def engine_choice(config: pytest.Config) -> EngineChoice:
    """Each model's engine class as the ``pytest_fp8gate_engine_class`` hook answers it (hookspecs.py): a
    conftest's or a plugin's class, or None for the registry's."""
    def choose(spec: ModelSpec) -> type[Engine] | None:
        chosen: type[Engine] | None = config.hook.pytest_fp8gate_engine_class(spec=spec, config=config)
        return chosen

    return choose


def run_state(config: pytest.Config) -> RunState:
    """The run state of a run that asked for the gate (stashed by plugin.py's pytest_configure)."""
    return config.stash[STATE_KEY]


class GateSession:
    """One per test session: measurements (each engine started once) and verdicts."""

    def __init__(self, config: pytest.Config, gate_config: GateConfig, artifacts: Path) -> None:
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")

        def announce(line: str) -> None:
            # Shown live, past output capture, so the log tells each engine start.
            if reporter is None or capture is None:
                return
            with capture.global_and_fixture_disabled():
                reporter.write_line(line)

        self.state = run_state(config)
        settings = self.state.settings
        cache = None
        if settings.baseline_cache is not None:
            from ..run.baseline_cache import LOCK_WAIT_S, BaselineCache

            wait_s = LOCK_WAIT_S if settings.cache_wait_s is None else settings.cache_wait_s
            cache = BaselineCache(settings.baseline_cache, settings.update_baseline, announce, wait_s)
        self.artifacts = artifacts
        lifecycle.watch(artifacts)
        self.measurements = Measurements(gate_config, artifacts, self.state.needs, announce, cache,
                                         engine_choice(config), settings.compile_cache,
                                         progress_interval_s=settings.progress_interval_s)
        self.gate = Gate(gate_config, self.measurements, self.state.cases)
        self.state.session = self

    def evaluate(self, case: Case) -> Verdict:
        # Judging charges comparing, by rule; the measuring a rule starts charges its own spans.
        with self.measurements.time.span(timing.GATE, "judging", within=case.rule):
            return self.gate.evaluate(case)

    def enforce(self, case: Case, item: pytest.Item) -> None:
        """Evaluate a rule case; record it; fail the test with its explanation. With --fp8gate-baseline-only,
        measure or restore the baseline and skip."""
        baseline_only = self.state.settings.baseline_only
        try:
            verdict = None if baseline_only else self.evaluate(case)
            origin = self.measurements.record().origin if baseline_only else None
        except Fp8GateError as err:  # every error of the gate's own says what is wrong in one line
            reason: str | None = str(err)
        else:
            reason = None
        if reason is not None:  # failed outside the except block, so no "During handling" chain is shown
            pytest.fail(reason, pytrace=False)
        if verdict is None:
            pytest.skip(f"--fp8gate-baseline-only: the baseline is {origin}; candidate {case.candidate} is judged "
                        "by a run without that option")
        item.stash[VERDICT_KEY] = verdict
        self.state.verdicts.append(verdict)
        if not verdict.passed:
            pytest.fail(verdict.explain(), pytrace=False)
