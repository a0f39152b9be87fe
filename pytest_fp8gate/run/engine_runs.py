"""Engine runs: one engine at a time, started and stopped for a model, and what each run leaves on disk.

Every start is announced, timed and kept (``runs``: its start, duration, settings and free GPU memory,
also in ``gpu_memory.json``); each model gets ``provenance.json`` (where its artifacts came from) and
``engine.json`` (what its engine measured of itself). Which engine runs a model is the engines' choice
(``engines.backend``), and so is what of it the baseline cache's key holds.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import checkpoint, hardware, progress, timing
from ..atomic import atomic_write_text
from ..config.spec import PRECISION_PASSES, GateConfig, ModelSpec
from ..core.dumps import RUN_ID
from ..engines import capabilities, provenance, stack
from ..engines.backend import EngineChoice, engine_class_for, prepare_process
from ..engines.base import Engine
from ..errors import ComparisonError, MeasurementError
from ..options import COMPILE_CACHE_ENV
from .record import NOISE_STRIDE, ModelResult


class EngineRuns:
    """The session's engine runs, one at a time, and the records they leave."""

    def __init__(self, config: GateConfig, artifacts: Path, announce: Callable[[str], None],
                 engine_class: type[Engine] | EngineChoice | None, compile_cache: Path | None,
                 progress_interval_s: float) -> None:
        """``engine_class``: what runs each model (``engines.backend.engine_class_for``: a class for every model,
        the pytest hook's choice, or None: the registry's for the model's backend); ``compile_cache``: vLLM's
        cache root for every engine and managed server (None: vLLM's own default)."""
        self.engine_class = engine_class
        # Process-wide, so set once here, before any engine of the session starts.
        prepare_process(config, engine_class)
        self.config = config
        self.artifacts = artifacts
        self.announce = announce
        self.progress = progress.Reporter(announce, progress_interval_s)
        # Under each model's env, which may name its own; a location, so no cache key holds it.
        self.cache_env = {} if compile_cache is None else {COMPILE_CACHE_ENV: str(compile_cache)}
        self.runs: list[dict[str, Any]] = []  # start time, duration and settings of each engine
        self.time = timing.TimeLedger()  # where this session's wall time goes
        self.run_id = uuid.uuid4().hex  # written into every artifact of this session
        self._fingerprints: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def running(self, spec: ModelSpec, label: str, dtype: str | None = None) -> Iterator[Engine]:
        """A started engine for ``spec`` with its ``env`` applied, shut down on leaving."""
        engine_class = engine_class_for(spec, self.engine_class)
        with engine_class.applied_env({**self.cache_env, **spec.env}), \
                self._started(engine_class, spec, label, dtype) as engine:
            yield engine

    @contextlib.contextmanager
    def _started(self, engine_class: type[Engine], spec: ModelSpec, label: str, dtype: str | None
                 ) -> Iterator[Engine]:
        """A started engine, shut down on leaving. Its start time, duration and settings are recorded,
        and free GPU memory before the start, while it runs and after the shutdown."""
        self.announce(f"fp8gate: engine start: {label} ({spec.model}, quantization={spec.quantization})")
        started_at, started = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
        memory = {"before_start": hardware.cuda_free_memory_mib()}
        if (start_note := engine_class.start_note()) is not None:
            self.announce(f"fp8gate: {label}: {start_note}")
        start_part = "engine start" if label == spec.name else f"engine start ({label})"
        with self.time.span(spec.name, start_part), self.progress.tracking(f"{label} engine start"):
            engine = engine_class(spec, max_logprobs=self.max_logprobs(), dtype=dtype)
        self.time.note_within(spec.name, start_part, engine.startup_phases())
        note = capabilities.version_note(engine.capabilities.vllm_version)
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
            self.runs.append({"label": label, "name": spec.name, "started_at": started_at,
                              "duration_s": round(time.perf_counter() - started, 3),
                              "startup_s": round(engine.start_s, 3), "kwargs": engine.kwargs,
                              "env": dict(spec.env), "compile_cache": os.environ.get(COMPILE_CACHE_ENV),
                              "vllm": facts, "capabilities": engine.capabilities.as_dict(),
                              "gpu_free_mib": memory})
            # Free MiB per visible GPU before start, while running, after shutdown (None: no GPU).
            atomic_write_text(self.artifacts / "gpu_memory.json", json.dumps(
                {run["label"]: run["gpu_free_mib"] for run in self.runs}, indent=1))

    def of(self, spec: ModelSpec) -> list[dict[str, Any]]:
        """The engine runs of one model so far."""
        return [run for run in self.runs if run["name"] == spec.name]

    # ---- settings ----------------------------------------------------------

    def max_logprobs(self) -> int:
        probs = self.config.probabilities
        if probs is None:
            return 1
        return -1 if self.full_vocab() else probs.top_k

    def full_vocab(self) -> bool:
        """Whether the passes ask for whole distributions: as the thresholds file says, else where the
        baseline's vocabulary is within what its engine returns whole."""
        probs = self.config.probabilities
        if probs is None or probs.full_vocab is False:
            return False
        if probs.full_vocab is True:
            return True
        baseline = self.config.baseline
        limit = engine_class_for(baseline, self.engine_class).full_vocab_limit
        return checkpoint.vocab_size_hint(baseline.model) <= limit

    def settings(self) -> dict[str, Any]:
        """Settings of the baseline's engines that come from the gate rather than the thresholds file."""
        baseline = self.config.baseline
        return {"max_logprobs": self.max_logprobs(), "full_vocab": self.full_vocab(),
                "in_process": self.config.deterministic_scheduling, "noise_stride": NOISE_STRIDE,
                **{f"{name}_dtype": dtype for name, dtype in PRECISION_PASSES.items()},
                **engine_class_for(baseline, self.engine_class).cache_settings(baseline)}

    # ---- records -----------------------------------------------------------

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
                "engine_runs": self.of(spec)}

    def write_provenance(self, spec: ModelSpec) -> None:
        atomic_write_text(self.artifacts / spec.name / "provenance.json",
                          json.dumps(self.provenance(spec), indent=1, default=str))

    def pass_provenance(self, spec: ModelSpec, engine: Engine) -> dict[str, Any]:
        """The provenance each dump of a pass carries."""
        return {"environment": provenance.environment(), "model": self.fingerprint(spec),
                "kv_cache_scales": provenance.kv_scale_source(spec), "engine_kwargs": engine.kwargs}

    def write_facts(self, result: ModelResult, engine: Engine) -> None:
        """``engine.json``: what the model's engine measured of itself (start, KV capacity, speed, load)."""
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
            "provenance": self.pass_provenance(result.spec, engine),
        }
        atomic_write_text(self.artifacts / result.spec.name / "engine.json", json.dumps(facts, indent=1))

    def served_otherwise(self, engine: Engine) -> str | None:
        """How the engine serves its model when that is not what its name says (FP8 layers through a
        weight-only kernel), from its stack fingerprint; None where it says nothing."""
        fingerprint = engine.facts().get("stack")
        return stack.served_otherwise(fingerprint) if fingerprint else None

    def write_traceback(self, name: str, err: BaseException) -> Path:
        """A failed measurement's traceback, for whoever debugs it: ``<name>/error.txt``."""
        saved = self.artifacts / name / "error.txt"
        saved.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(saved, "".join(traceback.format_exception(err)))
        return saved
