"""Run each model's engine once and measure everything the collected rules need.

Order of a session: the baseline (main pass, then the batch-order noise pass in
the same engine lifetime), the FP16 noise engine if configured, then each
candidate when its first rule runs. One engine is resident at a time; every
measurement is written under the artifacts directory (atomically) so that
``fp8gate flips``, ``fp8gate compare-logprobs`` and lm-eval's tools read it.

``Measurements`` is what the gate and the pytest side ask; the engine runs (``engine_runs``), the
passes over the corpus and the tasks (``passes``), the steps beside them (``steps``) and the
baseline's measurement (``baseline_run``) do the work.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .. import progress
from ..config.spec import GateConfig, ModelSpec
from ..engines.backend import EngineChoice
from ..engines.base import Engine
from ..errors import Fp8GateError, MeasurementError
from .baseline_run import BaselineRun
from .engine_runs import EngineRuns
from .passes import BATCH_ORDER, Passes
from .record import BaselineRecord, ModelResult, Needs
from .steps import Steps

if TYPE_CHECKING:
    from .baseline_cache import BaselineCache

__all__ = ["BATCH_ORDER", "MeasurementError", "Measurements"]


def _with_generating_passes(need: Needs, config: GateConfig) -> Needs:
    """The acceptance rule reads the counters around every task and [load]'s levels, whichever rules asked."""
    if not need.speculative:
        return need
    return need | Needs(tasks=frozenset(task.name for task in config.tasks), load=config.load is not None)


class Measurements:
    """Lazily measured results of the baseline, its noise passes and the candidates."""

    def __init__(
        self,
        config: GateConfig,
        artifacts: Path,
        needs: dict[str, Needs],
        announce: Callable[[str], None],
        baseline_cache: BaselineCache | None = None,
        engine_class: type[Engine] | EngineChoice | None = None,
        compile_cache: Path | None = None,
        progress_interval_s: float = progress.DEFAULT_INTERVAL_S,
    ) -> None:
        """``engine_class``: what runs each model (``engines.backend.engine_class_for``; None: the registry's for
        the model's backend; a stand-in in the tests, the pytest hook's choice);
        ``compile_cache``: vLLM's cache root for every engine and managed server (None: vLLM's own default);
        ``progress_interval_s``: how often a long pass prints its progress line (0: never)."""
        self.engines = EngineRuns(config, artifacts, announce, engine_class, compile_cache, progress_interval_s)
        self.passes = Passes(self.engines)
        self.steps = Steps(self.engines, self.passes)
        self.needs = {name: _with_generating_passes(need, config) for name, need in needs.items()}
        self.baseline_run = BaselineRun(self.engines, self.passes, self.steps, self.needs)
        self.engine_class = engine_class
        self.config = config
        self.artifacts = artifacts
        self.announce = announce
        self.baseline_cache = baseline_cache
        self.baseline_record: BaselineRecord | None = None  # once measured or restored whole
        self.time = self.engines.time
        self.run_id = self.engines.run_id
        self._candidates: dict[str, ModelResult] = {}
        self._failures: dict[str, BaseException] = {}

    def record(self) -> BaselineRecord:
        """The baseline's record, measured or restored on the first call."""
        if self.baseline_record is None:
            self._once(self.config.baseline.name, self._measure_baseline)
        assert self.baseline_record is not None
        return self.baseline_record

    def baseline(self) -> ModelResult:
        return self.record().result

    def candidate(self, name: str) -> ModelResult:
        if name not in self._candidates:
            base = self.record()
            spec = next(c for c in self.config.candidates if c.name == name)
            self._once(name, lambda: self._candidates.__setitem__(
                name, self._measure_model(spec, self.needs.get(name, Needs()), base)))
        return self._candidates[name]

    def measured_candidates(self) -> dict[str, ModelResult]:
        """The candidates measured so far (asking measures nothing)."""
        return dict(self._candidates)

    @property
    def engine_runs(self) -> list[dict[str, Any]]:
        """Start time, duration and settings of each engine of this session."""
        return self.engines.runs

    def fingerprint(self, spec: ModelSpec) -> dict[str, Any]:
        return self.engines.fingerprint(spec)

    def provenance(self, spec: ModelSpec) -> dict[str, Any]:
        return self.engines.provenance(spec)

    def engine_settings(self) -> dict[str, Any]:
        return self.engines.settings()

    def baseline_key(self, needs: Needs) -> dict[str, Any]:
        return self.baseline_run.key(needs)

    def _once(self, name: str, measure: Callable[[], None]) -> None:
        """Measure a model at most once: a failure is re-raised to every later rule, never retried."""
        if name in self._failures:
            raise MeasurementError(f"{self._failures[name]} (earlier in this session; not retried)")
        try:
            measure()
        except Fp8GateError as err:
            # One of the gate's own checks failed (the corpus, the engine's output): the message says it all.
            self._failures[name] = MeasurementError(f"measuring {name}: {err}")
            raise self._failures[name] from None
        except Exception as err:
            # Caught at the edge (vLLM, lm-eval, the hub): one line in the report, often minutes
            # into an engine run; the traceback goes to a file for whoever debugs it.
            saved = self.engines.write_traceback(name, err)
            first = next((line for line in str(err).splitlines() if line.strip()), "")
            self._failures[name] = MeasurementError(
                f"measuring {name} failed: {type(err).__name__}: {first} (traceback: {saved})")
            raise self._failures[name] from None

    def _measure_baseline(self) -> None:
        self.baseline_record = self.baseline_run.fetch(self.baseline_cache, self._measure_baseline_engines)

    def _measure_baseline_engines(self) -> BaselineRecord:
        return self.baseline_run.measure()

    def _measure_model(self, spec: ModelSpec, needs: Needs, base: BaselineRecord) -> ModelResult:
        with self.engines.running(spec, spec.name) as engine:
            result = self.steps.main_run(engine, spec, needs, base)
            self.steps.run("decode", engine, result, needs, base)
            # The candidate against itself in another batch order: is it noisier than its baseline?
            own_floor = Needs(needs.probabilities, needs.tasks)
            result.noise = {label: self.passes.run(engine, spec, own_floor, label, base, BATCH_ORDER)
                            for label in self.config.noise.candidate_passes}
            self.steps.run("load", engine, result, needs, base)
        self.engines.write_provenance(spec)
        return result
