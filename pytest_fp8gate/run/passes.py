"""Passes: one model over the corpus and the tasks in a started engine, its dumps written as it goes.

The corpus is cut into chunks once, by the baseline's engine; every later pass scores the same chunks,
and a candidate's top-k run is also scored on the baseline's top-k ids where its engine can. The tasks
run through lm-eval, whose task manager is built once a session. A reference build (reference_builds)
is written from the baseline's weights and scored on the corpus in its own engine.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path
from typing import Any

from .. import checkpoint, timing
from ..config.spec import ModelSpec, TaskSpec
from ..core.dumps import RUN_ID, write_logprob_dump
from ..core.logprobs import LogprobRun, check_vocabulary
from ..engines.base import ALL_AT_ONCE, BatchLayout, Engine
from ..errors import IdScoringUnavailable, MeasurementError
from . import corpus, reference_builds
from .engine_runs import EngineRuns
from .record import NOISE_STRIDE, BaselineRecord, Needs, PassResult

BATCH_ORDER = BatchLayout(reverse=True, stride=NOISE_STRIDE)  # for prompt logprobs, generation and scoring alike


class Passes:
    """The session's passes over the corpus chunks and the tasks."""

    def __init__(self, engines: EngineRuns) -> None:
        self.engines = engines
        self.config = engines.config
        self.chunks: list[list[int]] = []  # the corpus, cut by the baseline's tokenizer
        self._task_manager: Any = None

    def cut_corpus(self, engine: Engine) -> None:
        """The corpus's chunks, by the baseline's engine."""
        assert self.config.probabilities is not None
        with self.engines.time.span(timing.GATE, "tokenizing the corpus"):
            self.chunks = corpus.chunk_corpus(engine, self.config.probabilities, self.config.path)

    def run(self, engine: Engine, spec: ModelSpec, needs: Needs, label: str, base: BaselineRecord | None,
            layout: BatchLayout = ALL_AT_ONCE, folder: str | None = None) -> PassResult:
        """One pass over the corpus and the tasks; ``base``: the baseline's record, whose top-k ids it scores
        (None: the baseline's own main pass); its dumps under ``folder`` (default: the model's name)."""
        engines = self.engines
        directory = engines.artifacts / (folder or spec.name) / label
        directory.mkdir(parents=True, exist_ok=True)
        result = PassResult(label)
        timings = []
        if needs.probabilities and self.chunks:
            assert self.config.probabilities is not None
            started = time.perf_counter()
            with engines.time.span(spec.name, f"{label} logprobs"), \
                    engines.progress.tracking(f"{spec.name} [{label}] log-probs", "chunks"):
                run = engine.prompt_logprobs(self.chunks, self.config.probabilities.top_k, engines.full_vocab(),
                                             layout)
                check_vocabulary(run, engine.vocab_size)
                run = self._with_base_ids(engine, run, base)
                result.logprobs_path = directory / "logprobs.npz"
                write_logprob_dump(result.logprobs_path, run, {
                    "model": spec.model, "name": spec.name, "pass": label, "quantization": spec.quantization,
                    RUN_ID: engines.run_id, "provenance": engines.pass_provenance(spec, engine)})
            result.logprobs = run
            timings.append(f"logprobs {time.perf_counter() - started:.1f} s")
        for task in self.config.tasks:
            if task.name in needs.tasks:
                started = time.perf_counter()
                with engines.time.span(spec.name, f"{label} {task.name}"), \
                        engines.progress.tracking(f"{spec.name} [{label}] {task.name}"):
                    result.samples[task.name] = self._run_task(engine, task, directory, layout)
                timings.append(f"{task.name} {time.perf_counter() - started:.1f} s")
        engines.announce(f"fp8gate: measured {spec.name} [{label}]: {', '.join(timings) or 'nothing needed'}")
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
            on_base_ids = engine.logprobs_on_ids(self.chunks, base.top_ids)
        except IdScoringUnavailable as err:
            record.id_scoring_refusal = str(err)
            self.engines.announce(f"fp8gate: the engine cannot score the baseline's top-k ids ({err}); "
                                  "KL uses the ids each model returned in its own top-k")
            return run
        return dataclasses.replace(run, logprobs_on_base_ids=on_base_ids)

    def reference(self, spec: ModelSpec, name: str, record: BaselineRecord) -> PassResult:
        """The reference build ``name`` written from the baseline's weights, scored on the corpus in its own
        engine with the baseline's settings; the written checkpoint is removed once its engine stops."""
        label = f"reference-{name}"
        try:
            source = checkpoint.weights_dir(spec.model)
        except (OSError, ValueError) as err:  # a hub id not in the local cache (LocalEntryNotFoundError), or no path
            raise MeasurementError(f"reference {name}: the baseline's weights ({spec.model}) are not on this "
                                   f"machine as a checkpoint directory: {err}") from None
        engines = self.engines
        with tempfile.TemporaryDirectory(prefix=f".{label}-", dir=engines.artifacts) as scratch:
            with engines.time.span(spec.name, f"writing {label}"), \
                    engines.progress.tracking(f"{spec.name} writing {label}"):
                try:
                    build = reference_builds.write_build(name, source, Path(scratch) / name)
                except ValueError as err:  # no safetensors weights to round
                    raise MeasurementError(f"reference {name}: {err}") from None
            reference = spec.on_weights(f"{spec.name}-{label}", str(build))
            with engines.running(reference, reference.name) as engine:
                # Among the baseline's artifacts, which the baseline cache keeps together.
                return self.run(engine, reference, Needs(probabilities=True), label, record, folder=spec.name)

    # ---- lm-eval -----------------------------------------------------------

    def _tasks(self) -> Any:
        """lm-eval's task manager, built once: indexing task files is slow."""
        from . import lm_tasks

        if self._task_manager is None:
            with self.engines.time.span(timing.GATE, "indexing lm-eval's tasks"):
                self._task_manager = lm_tasks.task_manager(self.config.tasks)
        return self._task_manager

    def task_problem(self, names: frozenset[str]) -> str | None:
        """Why the tasks ``names`` cannot run (an unknown task, too few examples for the shots), or None."""
        from . import lm_tasks

        tasks = [task for task in self.config.tasks if task.name in names]
        if not tasks:
            return None
        known = self._tasks().all_tasks
        unknown = lm_tasks.task_name_problems(self.config, known, known, names)
        return unknown[0] if unknown else lm_tasks.task_problem(tasks, self._tasks())

    def _run_task(self, engine: Engine, task: TaskSpec, directory: Path, layout: BatchLayout) -> Path:
        from . import lm_adapter

        return lm_adapter.run_task(engine, task, directory, self._tasks(), self.engines.run_id, layout)
