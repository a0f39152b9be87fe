"""Steps: what an engine run measures beside its passes: speed, the decode phase (and the baseline's decode
floors), [load]'s levels, and speculative decoding's counters around what they count; and the first of
every model's engine runs, whose main pass opens the model's record.

Which step runs is one table (``STEPS``), keyed by the ``Needs`` field that asks for the step: a step runs
where the model's rules ask for it and the thresholds file has each table it reads.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from .. import checkpoint, gpu_bandwidths
from ..config.spec import ModelSpec
from ..core import spec_decode
from ..core.dumps import RUN_ID
from ..engines import nvml
from ..engines.base import ALL_AT_ONCE, BatchLayout, Engine
from . import decode_passes
from .engine_runs import EngineRuns
from .passes import Passes
from .record import BaselineRecord, ModelResult, Needs


class Steps:
    """The session's steps beside the passes."""

    def __init__(self, engines: EngineRuns, passes: Passes) -> None:
        self.engines = engines
        self.passes = passes  # the decode phase's prompts open the corpus's chunks
        self.config = engines.config

    def run(self, name: str, engine: Engine, result: ModelResult, needs: Needs, base: BaselineRecord | None) -> None:
        """Step ``name`` of ``result``'s engine run where ``needs`` asks for it; ``base``: the baseline's
        record (None while measuring the baseline)."""
        step = STEPS[name]
        if getattr(needs, name) and all(getattr(self.config, table) is not None for table in step.tables):
            step.measure(self, engine, result, needs, base)

    def main_run(self, engine: Engine, spec: ModelSpec, needs: Needs, base: BaselineRecord | None) -> ModelResult:
        """A model's record from its main pass (scored on the baseline's top-k ids where ``base`` is given), with
        speed and the engine's facts: the first of every engine run of a model."""
        # The main pass only: the baseline's noise passes and the speed run are not in its window.
        with self.counted("main", engine, needs) as windows:
            main = self.passes.run(engine, spec, needs, "main", base)
            result = ModelResult(spec, main, engine.start_s, engine.kv_cache_tokens(), engine.vocab_size)
        result.spec_decode = windows or None
        result.served_otherwise = self.engines.served_otherwise(engine)
        self.run("speed", engine, result, needs, base)
        self.engines.write_facts(result, engine)
        return result

    @contextlib.contextmanager
    def counted(self, label: str, engine: Engine, needs: Needs) -> Iterator[list[spec_decode.Window]]:
        """Speculative decoding's counters around what runs inside, as the window ``label`` in the list it
        yields (left empty where ``needs`` does not ask for them)."""
        windows: list[spec_decode.Window] = []
        before = engine.spec_decode_reading() if needs.speculative else None
        yield windows
        if before is not None:
            windows.append(spec_decode.window(label, before, engine.spec_decode_reading()))

    def _speed(self, engine: Engine, result: ModelResult, needs: Needs, base: BaselineRecord | None) -> None:
        s = self.config.speed
        assert s is not None
        name = result.spec.name
        with self.engines.time.span(name, "speed"), self.engines.progress.tracking(f"{name} [speed]"):
            result.latency = engine.latency(s.input_len, s.output_len, s.batch_size, s.warmup_iters, s.iters,
                                            min_iters=s.min_iters, target_rel_se=s.target_rel_se)
        self.look_up_speed_inputs(result)

    def look_up_speed_inputs(self, result: ModelResult) -> None:
        """What the speed rule judges against, looked up now so that judging probes nothing."""
        speed = self.config.speed
        assert speed is not None
        # A configured bandwidth is judged as given; otherwise the GPU's figure, if the table lists it.
        result.memory_bandwidth = None if speed.bandwidth_gbps > 0 else nvml.detected_bandwidth(speed.gpu)
        result.weights = checkpoint.weights_dir(result.spec.model)
        if result.memory_bandwidth is not None and gpu_bandwidths.find_gpu(result.memory_bandwidth[0]):
            result.bandwidth_warning = nvml.nvml_disagreement(result.memory_bandwidth[1])  # does NVML agree?

    def _decode(self, engine: Engine, result: ModelResult, needs: Needs, base: BaselineRecord | None) -> None:
        """The decode phase of one model (decode_passes): the baseline's first (``base`` None), then each
        candidate's, which also prefills the baseline's continuations."""
        decode, probabilities = self.config.decode, self.config.probabilities
        assert decode is not None and probabilities is not None
        spec, engines = result.spec, self.engines
        baseline = base.result.decode if base is not None else None
        started = time.perf_counter()
        with engines.time.span(spec.name, "decode"), engines.progress.tracking(f"{spec.name} [decode]", "sequences"):
            result.decode = decode_passes.measure_model(
                engine, decode_passes.decode_prompts(self.passes.chunks, decode), decode, probabilities.top_k,
                engines.full_vocab(), baseline.own if baseline else None, ALL_AT_ONCE)
            decode_passes.write_dumps(engines.artifacts / spec.name / "decode", result.decode,
                                      {"model": spec.model, "name": spec.name, RUN_ID: engines.run_id})
        engines.announce(f"fp8gate: measured {spec.name} [decode]: {time.perf_counter() - started:.1f} s")

    def decode_floor(self, engine: Engine, needs: Needs, record: BaselineRecord, label: str,
                     layout: BatchLayout = ALL_AT_ONCE) -> None:
        """A baseline noise pass's prefill of the baseline's continuations (the decode phase's floor)."""
        if needs.decode:
            decode = record.result.decode
            assert self.config.probabilities is not None and decode is not None  # measured in the main engine
            baseline = self.config.baseline.name
            # Its own part of the time table: left out, it was charged to the first rule judged.
            with self.engines.time.span(baseline, f"{label} decode floor"):
                record.decode_floor[label] = decode_passes.score_by_prefill(
                    engine, decode.own, self.config.probabilities.top_k, self.engines.full_vocab(), layout)
                decode_passes.write_floor_dump(self.engines.artifacts / baseline / "decode", decode, label,
                                               record.decode_floor[label],
                                               {"name": baseline, RUN_ID: self.engines.run_id})

    def _load(self, engine: Engine, result: ModelResult, needs: Needs, base: BaselineRecord | None) -> None:
        """[load]'s levels, last in the engine's lifetime: their random prompts then evict none of the
        passes' prompts from the server's prefix cache. The same seed for every model: the same prompts."""
        assert self.config.load is not None
        name, engines = result.spec.name, self.engines
        started = time.perf_counter()
        with self.counted("load", engine, needs) as windows:
            with engines.time.span(name, "load"), engines.progress.tracking(f"{name} [load]"):
                result.load = engine.load_levels(self.config.load)
        if windows:
            result.spec_decode = [*(result.spec_decode or []), *windows]
        engines.write_facts(result, engine)  # engine.json gets the levels
        engines.announce(f"fp8gate: measured {name} [load]: " + ", ".join(
            f"c={level.concurrency} {level.output_tok_s:.1f} tok/s" for level in result.load)
            + f" in {time.perf_counter() - started:.1f} s")


@dataclass(frozen=True)
class Step:
    tables: tuple[str, ...]  # the thresholds tables (GateConfig fields) it reads: it runs only where each is set
    measure: Callable[[Steps, Engine, ModelResult, Needs, BaselineRecord | None], None]


# Keyed by the Needs field that asks for the step.
STEPS: dict[str, Step] = {
    "speed": Step(("speed",), Steps._speed),
    "decode": Step(("decode", "probabilities"), Steps._decode),
    "load": Step(("load",), Steps._load),
}
