"""The baseline's measurement: its record restored from the baseline cache, or its engine runs (the main pass,
the batch-order noise pass and the decode phase in one engine, the FP16/FP32 noise engines, the reference
builds), measuring what any candidate's rules need.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import timing
from ..config.spec import BATCH_ORDER_PASS, PRECISION_PASSES
from ..errors import MeasurementError
from . import preflight
from .cache_key import baseline_key
from .endpoint_drift import endpoint_drift
from .engine_runs import EngineRuns
from .passes import BATCH_ORDER, Passes
from .record import BaselineRecord, Needs
from .steps import Steps

if TYPE_CHECKING:
    from .baseline_cache import BaselineCache


class BaselineRun:
    """Measures the baseline once for every candidate's ``needs``, or restores it."""

    def __init__(self, engines: EngineRuns, passes: Passes, steps: Steps, needs: dict[str, Needs]) -> None:
        self.engines, self.passes, self.steps = engines, passes, steps
        self.config = engines.config
        self.needs = needs

    def all_needs(self) -> Needs:
        total = Needs()
        for need in self.needs.values():
            total = total | need
        return total

    def key(self, needs: Needs) -> dict[str, Any]:
        """The baseline cache's key: everything that changes the baseline's numbers."""
        return baseline_key(self.config, needs, self.engines.settings(), self.engines.fingerprint(self.config.baseline))

    def fetch(self, cache: BaselineCache | None, measure: Callable[[], BaselineRecord]) -> BaselineRecord:
        """The baseline's record: restored from ``cache`` where it holds a valid entry, else ``measure()``
        (stored in the cache where there is one)."""
        with self.engines.time.span(timing.GATE, "preflight"):
            problem = preflight.machine_problem(self.config, self.needs)
        if problem:
            raise MeasurementError(problem)
        # The seam of the baseline cache: it returns a stored record, or measures one and stores it.
        if cache is None:
            record = measure()
        else:
            spec = self.config.baseline
            external = spec.served is not None and not spec.served.managed
            with self.engines.time.span(timing.GATE, "baseline cache"):  # a miss's engines charge their own spans
                record = cache.fetch(spec, self.key(self.all_needs()), self.engines.artifacts / spec.name, measure,
                                     (lambda restored: endpoint_drift(restored, self.engines)) if external else None)
                if self.all_needs().speed and record.cached:  # where this checkout keeps the weights
                    self.steps.look_up_speed_inputs(record.result)
        self.passes.chunks = record.chunks
        return record

    def measure(self) -> BaselineRecord:
        """The baseline's engine runs, one after another."""
        spec, needs = self.config.baseline, self.all_needs()
        # Only the probability and answer rules read a noise floor: a speed-only run starts no noise engine.
        passes = self.config.noise.passes if needs.probabilities or needs.tasks or needs.decode else ()
        with self.engines.time.span(timing.GATE, "preflight"):
            problem = preflight.hub_problem(self.config, self.needs) or self.passes.task_problem(needs.tasks)
        if problem:
            raise MeasurementError(problem)
        with self.engines.running(spec, spec.name) as engine:
            if needs.probabilities or needs.decode:
                self.passes.cut_corpus(engine)
            result = self.steps.main_run(engine, spec, needs, base=None)
            # Built once the main pass is there: the noise passes score the baseline's top-k ids on it.
            record = BaselineRecord(result, self.passes.chunks, [])
            if BATCH_ORDER_PASS in passes:
                result.noise[BATCH_ORDER_PASS] = self.passes.run(engine, spec, needs, BATCH_ORDER_PASS, record,
                                                                 BATCH_ORDER)
            # After the passes without it, so that what it leaves in the prefix cache changes none of them.
            self.steps.run("decode", engine, result, needs, None)
            if BATCH_ORDER_PASS in passes:
                self.steps.decode_floor(engine, needs, record, BATCH_ORDER_PASS, BATCH_ORDER)
            self.steps.run("load", engine, result, needs, None)
        for name in self.config.noise.precision_passes if passes else ():
            with self.engines.running(spec, f"{spec.name}-{name}", dtype=PRECISION_PASSES[name]) as engine:
                result.noise[name] = self.passes.run(engine, spec, needs, name, record)
                self.steps.decode_floor(engine, needs, record, name)
        probabilities = self.config.probabilities
        for name in probabilities.measured_references if probabilities is not None and needs.probabilities else ():
            result.references[name] = self.passes.reference(spec, name, record)
        self.engines.write_provenance(spec)
        record.engine_runs = self.engines.of(spec)
        return record
