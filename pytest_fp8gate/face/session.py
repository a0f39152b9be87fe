"""The gate's session: its stash keys and the GateSession (plugin.py's fixtures hand it to tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from .. import timing
from ..config.spec import GateConfig
from ..engines import lifecycle
from ..engines.base import Engine
from ..engines.vllm_engine import VllmEngine
from ..errors import Fp8GateError
from ..judge.gate import Gate
from ..judge.verdict import Case, Verdict
from ..options import SETTINGS_KEY
from ..run.measure import Measurements
from ..run.record import Needs

CONFIG_KEY = pytest.StashKey[GateConfig | None]()  # the loaded thresholds, None without a file
NEEDS_KEY = pytest.StashKey[dict[str, Needs]]()
VERDICTS_KEY = pytest.StashKey[list[Verdict]]()
VERDICT_KEY = pytest.StashKey[Verdict]()  # on each rule item, for the JSON report
SESSION_KEY = pytest.StashKey["GateSession"]()  # for the report written at session end
# What starts the engines: vLLM's, unless a plugin stands another in (the tests' fake engine).
ENGINE_CLASS_KEY = pytest.StashKey[type[Engine]]()


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

        settings = config.stash[SETTINGS_KEY]
        cache = None
        if settings.baseline_cache is not None:
            from ..run.baseline_cache import BaselineCache

            cache = BaselineCache(settings.baseline_cache, settings.update_baseline, announce)
        self.config = config
        self.artifacts = artifacts
        lifecycle.watch(artifacts)
        self.measurements = Measurements(gate_config, artifacts, config.stash.get(NEEDS_KEY, {}), announce, cache,
                                         config.stash.get(ENGINE_CLASS_KEY, VllmEngine), settings.compile_cache)
        self.gate = Gate(gate_config, self.measurements)
        config.stash[SESSION_KEY] = self

    def evaluate(self, case: Case) -> Verdict:
        # Judging charges comparing; the measuring a rule starts charges its own spans.
        with self.measurements.time.span(timing.GATE, "judging"):
            return self.gate.evaluate(case)

    def enforce(self, case: Case, item: pytest.Item) -> None:
        """Evaluate a rule case; record it; fail the test with its explanation."""
        try:
            verdict = self.evaluate(case)
        except Fp8GateError as err:  # every error of the gate's own says what is wrong in one line
            reason: str | None = str(err)
        else:
            reason = None
        if reason is not None:  # failed outside the except block, so no "During handling" chain is shown
            pytest.fail(reason, pytrace=False)
        item.stash[VERDICT_KEY] = verdict
        self.config.stash.setdefault(VERDICTS_KEY, []).append(verdict)
        if not verdict.passed:
            pytest.fail(verdict.explain(), pytrace=False)

