"""Run each model's engine once and measure everything the collected rules need.

Order of a session: the baseline (main pass, then the batch-order noise pass in
the same engine lifetime), the FP16 noise engine if configured, then each
candidate when its first rule runs. One engine is resident at a time; every
measurement is written under the artifacts directory (atomically) so that
``fp8gate flips``, ``fp8gate compare-logprobs`` and lm-eval's tools read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
import time
import traceback
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import numpy as np

from .. import checkpoint, gpu_bandwidths, hardware, progress, timing
from ..atomic import atomic_write_text
from ..config.spec import BATCH_ORDER_PASS, PRECISION_PASSES, GateConfig, ModelSpec, TaskSpec
from ..core import spec_decode
from ..core.dumps import RUN_ID, write_logprob_dump
from ..core.logprobs import LogprobRun, check_vocabulary
from ..engines import capabilities as capabilities_mod
from ..engines import nvml, provenance
from ..engines import stack as stack_mod
from ..engines.backend import EngineChoice, engine_class_for, prepare_process
from ..engines.base import ALL_AT_ONCE, BatchLayout, Engine
from ..engines.vllm_engine import FULL_VOCAB_LIMIT, applied_env
from ..errors import ComparisonError, Fp8GateError, IdScoringUnavailable, MeasurementError
from ..options import COMPILE_CACHE_ENV
from . import corpus as corpus_mod
from . import decode_passes, preflight, reference_builds
from .record import NOISE_STRIDE, BaselineRecord, DecodeResult, ModelResult, Needs, PassResult

if TYPE_CHECKING:
    from .baseline_cache import BaselineCache

BATCH_ORDER = BatchLayout(reverse=True, stride=NOISE_STRIDE)  # for prompt logprobs, generation and scoring alike
# A restored endpoint baseline's probe (Measurements._endpoint_drift): the live chunk may differ from the
# cached one by this times the batch-order floor's difference on it, and by this many nats in any case.
DRIFT_FLOOR_FACTOR = 2.0
DRIFT_MIN_NATS = 1e-3


def _with_generating_passes(need: Needs, config: GateConfig) -> Needs:
    """The acceptance rule reads the counters around every task and [load]'s levels, whichever rules asked."""
    if not need.speculative:
        return need
    return need | Needs(tasks=frozenset(task.name for task in config.tasks), load=config.load is not None)


def _mean_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |a - b| over positions; a position finite in one and not the other counts as infinite."""
    both = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    return float(np.mean(np.abs(a[both] - b[both]))) if both.any() else 0.0


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
        """``engine_class``: what starts an engine for a model (``engines.backend.engine_class_for``: a stand-in
        in the tests, the pytest hook's choice; None: the registry's for each model's backend); ``compile_cache``:
        vLLM's cache root for every engine and managed server (None: vLLM's own default);
        ``progress_interval_s``: how often a long pass prints its progress line (0: never)."""
        # Process-wide, so set once here, before any engine of the session starts.
        prepare_process(config, engine_class)
        self.engine_class = engine_class
        self.config = config
        self.artifacts = artifacts
        self.needs = {name: _with_generating_passes(need, config) for name, need in needs.items()}
        self.announce = announce
        self.progress = progress.Reporter(announce, progress_interval_s)
        self.baseline_cache = baseline_cache
        # Under each model's env, which may name its own; a location, so no cache key holds it.
        self.cache_env = {} if compile_cache is None else {COMPILE_CACHE_ENV: str(compile_cache)}
        self.baseline_record: BaselineRecord | None = None  # once measured or restored whole
        self.engine_runs: list[dict[str, Any]] = []  # start time, duration and settings of each engine
        self.time = timing.TimeLedger()  # where this session's wall time goes (issue 33)
        self._fingerprints: dict[str, dict[str, Any]] = {}
        self.run_id = uuid.uuid4().hex  # written into every artifact of this session
        self._candidates: dict[str, ModelResult] = {}
        self._chunks: list[list[int]] = []
        self._task_manager: Any = None
        self._failures: dict[str, BaseException] = {}

    # ---- public ------------------------------------------------------------

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
            saved = self.artifacts / name / "error.txt"
            saved.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(saved, "".join(traceback.format_exception(err)))
            first = next((line for line in str(err).splitlines() if line.strip()), "")
            self._failures[name] = MeasurementError(
                f"measuring {name} failed: {type(err).__name__}: {first} (traceback: {saved})")
            raise self._failures[name] from None

    # ---- engines -----------------------------------------------------------

    @contextlib.contextmanager
    def _running(self, spec: ModelSpec, label: str, dtype: str | None = None) -> Iterator[Engine]:
        """A started engine for ``spec`` with its ``env`` applied, shut down on leaving."""
        with applied_env({**self.cache_env, **spec.env}), self._running_engine(spec, label, dtype) as engine:
            yield engine

    @contextlib.contextmanager
    def _running_engine(self, spec: ModelSpec, label: str, dtype: str | None = None) -> Iterator[Engine]:
        """A started engine for ``spec``, shut down on leaving. Its start time, duration and
        settings are recorded, and free GPU memory before the start, while it runs and after
        the shutdown."""
        self.announce(f"fp8gate: engine start: {label} ({spec.model}, quantization={spec.quantization})")
        started_at, started = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
        memory = {"before_start": hardware.cuda_free_memory_mib()}
        engine_class = engine_class_for(spec, self.engine_class)
        if (start_note := engine_class.start_note()) is not None:
            self.announce(f"fp8gate: {label}: {start_note}")
        start_part = "engine start" if label == spec.name else f"engine start ({label})"
        with self.time.span(spec.name, start_part), self.progress.tracking(f"{label} engine start"):
            engine = engine_class(spec, max_logprobs=self._max_logprobs(), dtype=dtype)
        self.time.note_within(spec.name, start_part, engine.startup_phases())
        note = capabilities_mod.version_note(engine.capabilities.vllm_version)
        if note:
            self.announce(f"fp8gate: {note}")
        memory["running"] = hardware.cuda_free_memory_mib()
        try:
            yield engine
        except ComparisonError as err:  # raised where a run is built from what the engine returned
            # A served engine names itself with its (redacted) URL; an in-process one by its model path.
            where = getattr(engine, "where", None) or f"{spec.name} ({spec.model})"
            raise MeasurementError(f"{where} returned log-probs the gate refuses: {err}") from None
        finally:
            with self.time.span(spec.name, "teardown"):
                facts = engine.facts()  # read before shutdown drops the engine
                engine.shutdown()
            memory["after_shutdown"] = hardware.cuda_free_memory_mib()
            self.engine_runs.append({"label": label, "name": spec.name, "started_at": started_at,
                                     "duration_s": round(time.perf_counter() - started, 3),
                                     "startup_s": round(engine.start_s, 3), "kwargs": engine.kwargs,
                                     "env": dict(spec.env), "compile_cache": os.environ.get(COMPILE_CACHE_ENV),
                                     "vllm": facts, "capabilities": engine.capabilities.as_dict(),
                                     "gpu_free_mib": memory})
            # Free MiB per visible GPU before start, while running, after shutdown (None: no GPU).
            atomic_write_text(self.artifacts / "gpu_memory.json", json.dumps(
                {run["label"]: run["gpu_free_mib"] for run in self.engine_runs}, indent=1))

    def engine_settings(self) -> dict[str, Any]:
        """Settings of the baseline's engines that come from the gate rather than the thresholds file."""
        settings = {"max_logprobs": self._max_logprobs(), "full_vocab": self._full_vocab_wanted(),
                    "in_process": self.config.deterministic_scheduling, "noise_stride": NOISE_STRIDE,
                    **{f"{name}_dtype": dtype for name, dtype in PRECISION_PASSES.items()}}
        served = self.config.baseline.served
        if served is not None:  # issue 20: the whole command line and environment change the numbers
            from ..engines.served_engine import cache_key

            settings["served"] = cache_key(served)
        return settings

    def baseline_key(self, needs: Needs) -> dict[str, Any]:
        """The baseline cache's key: everything that changes the baseline's numbers."""
        from .baseline_cache import baseline_key

        return baseline_key(self.config, needs, self.engine_settings(), self.fingerprint(self.config.baseline))

    def fingerprint(self, spec: ModelSpec) -> dict[str, Any]:
        """Model id, revision and weights hash, computed once per model."""
        if spec.name not in self._fingerprints:
            self._fingerprints[spec.name] = provenance.model_fingerprint(spec)
        return self._fingerprints[spec.name]

    def provenance(self, spec: ModelSpec) -> dict[str, Any]:
        """Where one model's artifacts came from (its engines so far included)."""
        probabilities = self.config.probabilities
        return {"environment": provenance.environment(), "model": self.fingerprint(spec),
                "kv_cache_scales": provenance.kv_scale_source(spec),
                "inputs": provenance.inputs(probabilities.corpus if probabilities else None, self.config.tasks),
                "lm_eval_seeds": provenance.lm_eval_seeds() if self.config.tasks else None,
                "engine_runs": [run for run in self.engine_runs if run["name"] == spec.name]}

    def _write_provenance(self, spec: ModelSpec) -> None:
        atomic_write_text(self.artifacts / spec.name / "provenance.json",
                          json.dumps(self.provenance(spec), indent=1, default=str))

    def _max_logprobs(self) -> int:
        probs = self.config.probabilities
        if probs is None:
            return 1
        return -1 if self._full_vocab_wanted() else probs.top_k

    def _full_vocab_wanted(self) -> bool:
        probs = self.config.probabilities
        if probs is None or probs.full_vocab is False:
            return False
        if probs.full_vocab is True:
            return True
        return checkpoint.vocab_size_hint(self.config.baseline.model) <= FULL_VOCAB_LIMIT

    def _all_needs(self) -> Needs:
        total = Needs()
        for need in self.needs.values():
            total = total | need
        return total

    def _measure_baseline(self) -> None:
        with self.time.span(timing.GATE, "preflight"):
            keys = preflight.key_problems(self.config, self.needs)
            problem = keys[0] if keys else preflight.parallelism_problem(
                self.config, len(hardware.cuda_device_names()), self.needs)
        if problem:
            raise MeasurementError(problem)
        # The seam of the baseline cache: it returns a stored record, or measures one and stores it.
        if self.baseline_cache is None:
            record = self._measure_baseline_engines()
        else:
            spec = self.config.baseline
            external = spec.served is not None and not spec.served.managed
            with self.time.span(timing.GATE, "baseline cache"):  # a miss's engines charge their own spans
                record = self.baseline_cache.fetch(spec, self.baseline_key(self._all_needs()),
                                                   self.artifacts / spec.name, self._measure_baseline_engines,
                                                   self._endpoint_drift if external else None)
                if self._all_needs().speed and record.cached:  # where this checkout keeps the weights
                    self._look_up_speed_inputs(record.result)
        self._chunks = record.chunks
        self.baseline_record = record

    def _endpoint_drift(self, record: BaselineRecord) -> str | None:
        """Why a restored endpoint baseline no longer holds, or None: its key knows only the URL, the served
        name and the local tokenizer, so weights changed behind them are caught by one probe: the first
        chunk's log-probs from the live endpoint against the restored ones, within twice the batch-order
        floor's mean |difference| on that chunk (at least DRIFT_MIN_NATS)."""
        spec = self.config.baseline
        probabilities = self.config.probabilities
        cached = record.result.main.logprobs
        if probabilities is None or cached is None or not record.chunks:
            self.announce(f"fp8gate: baseline {spec.name}: the cache entry holds no probability log-probs, so it "
                          "is not checked against the live endpoint (docs/usage.md: a redeploy behind the same URL "
                          "and name goes unnoticed; --fp8gate-update-baseline after one)")
            return None
        chunk = record.chunks[0]
        positions = len(chunk) - 1
        with self._running(spec, f"{spec.name}-cache-check") as engine:
            live = engine.prompt_logprobs([chunk], probabilities.top_k, self._full_vocab_wanted())
        drift = _mean_abs_difference(live.real_logprob[:positions], cached.real_logprob[:positions])
        floor = record.result.noise.get(BATCH_ORDER_PASS)
        noise = floor.logprobs if floor is not None else None
        floor_drift = 0.0 if noise is None else _mean_abs_difference(noise.real_logprob[:positions],
                                                                      cached.real_logprob[:positions])
        tolerance = max(DRIFT_FLOOR_FACTOR * floor_drift, DRIFT_MIN_NATS)
        if drift <= tolerance:
            return None
        return (f"the endpoint answers otherwise than when the entry was measured: the first chunk's real-token "
                f"log-probs differ by {drift:.3g} nats on average, over the tolerance {tolerance:.3g} "
                f"({DRIFT_FLOOR_FACTOR:g} x the batch-order floor's {floor_drift:.3g}, at least {DRIFT_MIN_NATS:g}); "
                "was it redeployed behind the same URL and name?")

    def _measure_baseline_engines(self) -> BaselineRecord:
        spec, needs = self.config.baseline, self._all_needs()
        # Only the probability and answer rules read a noise floor: a speed-only run starts no noise engine.
        passes = self.config.noise.passes if needs.probabilities or needs.tasks or needs.decode else ()
        with self.time.span(timing.GATE, "preflight"):
            problem = preflight.hub_problem(self.config, self.needs) or self._task_problem(needs.tasks)
        if problem:
            raise MeasurementError(problem)
        with self._running(spec, spec.name) as engine:
            if needs.probabilities or needs.decode:
                assert self.config.probabilities is not None
                with self.time.span(timing.GATE, "tokenizing the corpus"):
                    self._chunks = corpus_mod.chunk_corpus(engine, self.config.probabilities, self.config.path)
            result = self._measure_with(engine, spec, needs, base=None)
            # Built once the main pass is there: the noise passes score the baseline's top-k ids on it.
            record = BaselineRecord(result, self._chunks, [])
            if BATCH_ORDER_PASS in passes:
                result.noise[BATCH_ORDER_PASS] = self._passes(engine, spec, needs, BATCH_ORDER_PASS, record,
                                                              BATCH_ORDER)
            # After the passes without it, so that what it leaves in the prefix cache changes none of them.
            self._measure_decode(engine, result, needs, baseline=None)
            if BATCH_ORDER_PASS in passes:
                self._decode_floor(engine, needs, record, BATCH_ORDER_PASS, BATCH_ORDER)
            self._measure_load(engine, result, needs)
        for name in self.config.noise.precision_passes if passes else ():
            with self._running(spec, f"{spec.name}-{name}", dtype=PRECISION_PASSES[name]) as engine:
                result.noise[name] = self._passes(engine, spec, needs, name, record)
                self._decode_floor(engine, needs, record, name, ALL_AT_ONCE)
        probabilities = self.config.probabilities
        for name in probabilities.measured_references if probabilities is not None and needs.probabilities else ():
            result.references[name] = self._reference_pass(spec, name, record)
        self._write_provenance(spec)
        record.engine_runs = [run for run in self.engine_runs if run["name"] == spec.name]
        return record

    def _reference_pass(self, spec: ModelSpec, name: str, record: BaselineRecord) -> PassResult:
        """The reference build ``name`` written from the baseline's weights, scored on the corpus in its own
        engine with the baseline's settings; the written checkpoint is removed once its engine stops."""
        label = f"reference-{name}"
        try:
            source = checkpoint.weights_dir(spec.model)
        except (OSError, ValueError) as err:  # a hub id not in the local cache (LocalEntryNotFoundError), or no path
            raise MeasurementError(f"reference {name}: the baseline's weights ({spec.model}) are not on this "
                                   f"machine as a checkpoint directory: {err}") from None
        with tempfile.TemporaryDirectory(prefix=f".{label}-", dir=self.artifacts) as scratch:
            with self.time.span(spec.name, f"writing {label}"), self.progress.tracking(f"{spec.name} writing {label}"):
                try:
                    build = reference_builds.write_build(name, source, Path(scratch) / name)
                except ValueError as err:  # no safetensors weights to round
                    raise MeasurementError(f"reference {name}: {err}") from None
            reference = dataclasses.replace(spec, name=f"{spec.name}-{label}", model=str(build))
            if spec.served is not None:  # a managed server: the same serve line on the build
                command = ("serve", str(build), *spec.served.command[2:])
                reference = dataclasses.replace(reference, served=dataclasses.replace(spec.served, command=command))
            with self._running(reference, reference.name) as engine:
                # Among the baseline's artifacts, which the baseline cache keeps together.
                return self._passes(engine, reference, Needs(probabilities=True), label, record, folder=spec.name)

    def _measure_model(self, spec: ModelSpec, needs: Needs, base: BaselineRecord) -> ModelResult:
        with self._running(spec, spec.name) as engine:
            result = self._measure_with(engine, spec, needs, base)
            self._measure_decode(engine, result, needs, base.result.decode)
            # The candidate against itself in another batch order: is it noisier than its baseline?
            own_floor = Needs(needs.probabilities, needs.tasks)
            result.noise = {label: self._passes(engine, spec, own_floor, label, base, BATCH_ORDER)
                            for label in self.config.noise.candidate_passes}
            self._measure_load(engine, result, needs)
        self._write_provenance(spec)
        return result

    def _decode_floor(self, engine: Engine, needs: Needs, record: BaselineRecord, label: str,
                      layout: BatchLayout) -> None:
        """A baseline noise pass's prefill of the baseline's continuations (the decode phase's floor)."""
        if needs.decode:
            decode = record.result.decode
            assert self.config.probabilities is not None and decode is not None  # measured in the main engine
            baseline = self.config.baseline.name
            record.decode_floor[label] = decode_passes.score_by_prefill(
                engine, decode.own, self.config.probabilities.top_k, self._full_vocab_wanted(), layout)
            decode_passes.write_floor_dump(self.artifacts / baseline / "decode", decode, label,
                                           record.decode_floor[label], {"name": baseline, RUN_ID: self.run_id})

    def _measure_decode(self, engine: Engine, result: ModelResult, needs: Needs,
                        baseline: DecodeResult | None) -> None:
        """The decode phase of one model (decode_passes): the baseline's first (``baseline`` None), then each
        candidate's, which also prefills the baseline's continuations."""
        if not needs.decode or self.config.decode is None or self.config.probabilities is None:
            return
        spec = result.spec
        started = time.perf_counter()
        with self.time.span(spec.name, "decode"), self.progress.tracking(f"{spec.name} [decode]", "sequences"):
            result.decode = decode_passes.measure_model(
                engine, decode_passes.decode_prompts(self._chunks, self.config.decode), self.config.decode,
                self.config.probabilities.top_k, self._full_vocab_wanted(), baseline.own if baseline else None,
                ALL_AT_ONCE)
            decode_passes.write_dumps(self.artifacts / spec.name / "decode", result.decode,
                                      {"model": spec.model, "name": spec.name, RUN_ID: self.run_id})
        self.announce(f"fp8gate: measured {spec.name} [decode]: {time.perf_counter() - started:.1f} s")

    def _measure_with(self, engine: Engine, spec: ModelSpec, needs: Needs, base: BaselineRecord | None
                      ) -> ModelResult:
        """The main pass (scored on the baseline's top-k ids where ``base`` is given), speed and engine facts."""
        before = engine.spec_decode_reading() if needs.speculative else None
        main = self._passes(engine, spec, needs, "main", base)
        result = ModelResult(spec, main, engine.start_s, engine.kv_cache_tokens(), engine.vocab_size)
        if before is not None:  # the main pass only: the baseline's noise passes and the speed run are not in it
            result.spec_decode = [spec_decode.window("main", before, engine.spec_decode_reading())]
        stack = engine.facts().get("stack")
        result.served_otherwise = stack_mod.served_otherwise(stack) if stack else None
        if needs.speed and self.config.speed is not None:
            s = self.config.speed
            with self.time.span(spec.name, "speed"), self.progress.tracking(f"{spec.name} [speed]"):
                result.latency = engine.latency(s.input_len, s.output_len, s.batch_size, s.warmup_iters, s.iters,
                                                min_iters=s.min_iters, target_rel_se=s.target_rel_se)
            self._look_up_speed_inputs(result)
        self._write_engine_facts(spec.name, result, engine)
        return result

    def _measure_load(self, engine: Engine, result: ModelResult, needs: Needs) -> None:
        """[load]'s levels, last in the engine's lifetime: their random prompts then evict none of the
        passes' prompts from the server's prefix cache. The same seed for every model: the same prompts."""
        if not needs.load or self.config.load is None:
            return
        started = time.perf_counter()
        before = engine.spec_decode_reading() if needs.speculative else None
        with self.time.span(result.spec.name, "load"), self.progress.tracking(f"{result.spec.name} [load]"):
            result.load = engine.load_levels(self.config.load)
        if before is not None:
            result.spec_decode = [*(result.spec_decode or []),
                                  spec_decode.window("load", before, engine.spec_decode_reading())]
        self._write_engine_facts(result.spec.name, result, engine)  # engine.json gets the levels
        self.announce(f"fp8gate: measured {result.spec.name} [load]: " + ", ".join(
            f"c={level.concurrency} {level.output_tok_s:.1f} tok/s" for level in result.load)
            + f" in {time.perf_counter() - started:.1f} s")

    def _look_up_speed_inputs(self, result: ModelResult) -> None:
        """What the speed rule judges against, looked up now so that judging probes nothing."""
        speed = self.config.speed
        assert speed is not None
        # A configured bandwidth is judged as given; otherwise the GPU's figure, if the table lists it.
        result.memory_bandwidth = None if speed.bandwidth_gbps > 0 else nvml.detected_bandwidth(speed.gpu)
        result.weights = checkpoint.weights_dir(result.spec.model)
        if result.memory_bandwidth is not None and gpu_bandwidths.find_gpu(result.memory_bandwidth[0]):
            result.bandwidth_warning = nvml.nvml_disagreement(result.memory_bandwidth[1])  # does NVML agree?

    def _passes(self, engine: Engine, spec: ModelSpec, needs: Needs, label: str, base: BaselineRecord | None,
                layout: BatchLayout = ALL_AT_ONCE, folder: str | None = None) -> PassResult:
        """One pass over the corpus and the tasks; ``base``: the baseline's record, whose top-k ids it scores
        (None: the baseline's own main pass); its dumps under ``folder`` (default: the model's name)."""
        directory = self.artifacts / (folder or spec.name) / label
        directory.mkdir(parents=True, exist_ok=True)
        result = PassResult(label)
        timings = []
        if needs.probabilities and self._chunks:
            assert self.config.probabilities is not None
            started = time.perf_counter()
            with self.time.span(spec.name, f"{label} logprobs"), \
                    self.progress.tracking(f"{spec.name} [{label}] log-probs", "chunks"):
                run = engine.prompt_logprobs(self._chunks, self.config.probabilities.top_k,
                                             self._full_vocab_wanted(), layout)
                check_vocabulary(run, engine.vocab_size)
                run = self._with_base_ids(engine, run, base)
                result.logprobs_path = directory / "logprobs.npz"
                write_logprob_dump(result.logprobs_path, run, {
                    "model": spec.model, "name": spec.name, "pass": label, "quantization": spec.quantization,
                    RUN_ID: self.run_id, "provenance": self._pass_provenance(spec, engine)})
            result.logprobs = run
            timings.append(f"logprobs {time.perf_counter() - started:.1f} s")
        for task in self.config.tasks:
            if task.name in needs.tasks:
                started = time.perf_counter()
                with self.time.span(spec.name, f"{label} {task.name}"), \
                        self.progress.tracking(f"{spec.name} [{label}] {task.name}"):
                    result.samples[task.name] = self._run_task(engine, task, directory, layout)
                timings.append(f"{task.name} {time.perf_counter() - started:.1f} s")
        self.announce(f"fp8gate: measured {spec.name} [{label}]: {', '.join(timings) or 'nothing needed'}")
        return result

    def _with_base_ids(self, engine: Engine, run: LogprobRun, record: BaselineRecord | None) -> LogprobRun:
        """In top-k mode, add this run's log-probs on the baseline's top-k ids where the engine can.

        Without them the KL partition only knows the baseline ids that also
        made this model's own top-k. A refusal is kept on ``record``: no later pass asks again.
        """
        base = record.result.main.logprobs if record is not None else None
        if record is None or base is None or run.full_logprobs is not None or record.id_scoring_refusal is not None:
            return run
        try:
            on_base_ids = engine.logprobs_on_ids(self._chunks, base.top_ids)
        except IdScoringUnavailable as err:
            record.id_scoring_refusal = str(err)
            self.announce(f"fp8gate: the engine cannot score the baseline's top-k ids ({err}); "
                          "KL uses the ids each model returned in its own top-k")
            return run
        return dataclasses.replace(run, logprobs_on_base_ids=on_base_ids)

    def _tasks(self) -> Any:
        """lm-eval's task manager, built once: indexing task files is slow."""
        from . import lm_adapter

        if self._task_manager is None:
            with self.time.span(timing.GATE, "indexing lm-eval's tasks"):
                self._task_manager = lm_adapter.task_manager(self.config.tasks)
        return self._task_manager

    def _task_problem(self, names: frozenset[str]) -> str | None:
        from . import lm_adapter

        tasks = [task for task in self.config.tasks if task.name in names]
        if not tasks:
            return None
        known = self._tasks().all_tasks
        unknown = lm_adapter.task_name_problems(self.config, known, known, names)
        return unknown[0] if unknown else lm_adapter.task_problem(tasks, self._tasks())

    def _run_task(self, engine: Engine, task: TaskSpec, directory: Path, layout: BatchLayout) -> Path:
        from . import lm_adapter

        return lm_adapter.run_task(engine, task, directory, self._tasks(), self.run_id, layout)

    def _pass_provenance(self, spec: ModelSpec, engine: Engine) -> dict[str, Any]:
        return {"environment": provenance.environment(), "model": self.fingerprint(spec),
                "kv_cache_scales": provenance.kv_scale_source(spec), "engine_kwargs": engine.kwargs}

    def _write_engine_facts(self, name: str, result: ModelResult, engine: Engine) -> None:
        facts = {
            RUN_ID: self.run_id,
            "engine": engine.capabilities.as_dict(),
            "model": result.spec.model,
            "quantization": result.spec.quantization,
            "engine_start_s": result.start_s,
            "kv_cache_tokens": result.kv_cache_tokens,
            "latency": result.latency.as_dict() if result.latency else None,
            "load": [level.as_dict() for level in result.load] if result.load is not None else None,
            "spec_decode": [w.as_dict() for w in result.spec_decode] if result.spec_decode is not None else None,
            "provenance": self._pass_provenance(result.spec, engine),
        }
        atomic_write_text(self.artifacts / name / "engine.json", json.dumps(facts, indent=1))
