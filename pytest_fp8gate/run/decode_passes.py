"""The decode phase's passes through the engine interface (``engine.Engine``, the fake one, a server).

The baseline writes greedy continuations with decode-time log-probs; every
model then scores exact token ids (``prompt ids + generated ids``) by prefill.
Nothing is re-encoded from text.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config.spec import DecodeSpec
from ..core.decode_phase import DecodeRun, generated_index, generated_rows
from ..core.dumps import write_logprob_dump
from ..core.logprobs import LogprobRun, check_vocabulary
from ..errors import IdScoringUnavailable
from .record import DECODE_DUMP, FLOOR_DUMP, ON_BASELINE_DUMP, PREFILL_DUMP, DecodeResult

if TYPE_CHECKING:
    from ..engines.base import BatchLayout, Engine


def write_dumps(directory: Path, result: DecodeResult, metadata: dict[str, Any]) -> None:
    """Each run of ``result`` as a logprob dump under ``directory``; ``fp8gate compare-logprobs``
    on two of them recomputes a decode-phase verdict's figures."""
    directory.mkdir(parents=True, exist_ok=True)
    runs = {DECODE_DUMP: result.own.logprobs, PREFILL_DUMP: result.own_prefill, ON_BASELINE_DUMP: result.on_baseline}
    for name, run in runs.items():
        if run is not None:
            result.dumps[name] = directory / f"{name}.npz"
            write_logprob_dump(result.dumps[name], run, {**metadata, "decode": name})


def write_floor_dump(directory: Path, result: DecodeResult, label: str, run: LogprobRun,
                     metadata: dict[str, Any]) -> None:
    """A baseline noise pass's prefill of the baseline's continuations, as ``floor-<label>`` beside its dumps."""
    name = f"{FLOOR_DUMP}-{label}"
    result.dumps[name] = directory / f"{name}.npz"
    write_logprob_dump(result.dumps[name], run, {**metadata, "decode": name})


def decode_prompts(chunks: list[list[int]], spec: DecodeSpec) -> list[list[int]]:
    """The first ``prompt_tokens`` of the first ``prompts`` probability chunks."""
    return [list(chunk[:spec.prompt_tokens]) for chunk in chunks[:spec.prompts]]


def write_continuations(engine: Engine, prompts: list[list[int]], spec: DecodeSpec, top_k: int, full_vocab: bool,
                        layout: BatchLayout) -> DecodeRun:
    """Greedy continuations of ``new_tokens`` with the engine's decode-time log-probs."""
    written = engine.generate_with_logprobs(prompts, spec.new_tokens, top_k, full_vocab, layout)
    runs = [run for _, run in written]
    logprobs = LogprobRun(
        np.concatenate([r.real_logprob for r in runs]), np.concatenate([r.top_ids for r in runs]),
        np.concatenate([r.top_logprobs for r in runs]),
        full_logprobs=np.concatenate([r.full_logprobs for r in runs]) if full_vocab else None,
        token_ids=np.concatenate([np.asarray(ids, dtype=np.int64) for ids, _ in written]))
    check_vocabulary(logprobs, engine.vocab_size)
    return DecodeRun(tuple(tuple(p) for p in prompts), tuple(ids for ids, _ in written), logprobs)


def score_by_prefill(engine: Engine, run: DecodeRun, top_k: int, full_vocab: bool,
                     layout: BatchLayout) -> LogprobRun:
    """This engine's prefill of ``run``'s exact ids, rows of the generated positions only.

    In top-k mode the engine also scores ``run``'s own top-k ids where it can
    (``Engine.logprobs_on_ids``), so the KL partition sees every one of them.
    """
    sequences = [list(s) for s in run.sequences]
    prompt_lengths = [len(p) for p in run.prompts]
    scored = engine.prompt_logprobs(sequences, top_k, full_vocab, layout)
    check_vocabulary(scored, engine.vocab_size)
    rows = generated_rows(scored, prompt_lengths, run.lengths)
    if full_vocab:
        return rows
    # One id row per scored position of the sequences: the prompt rows ask for id 0, which is not read.
    ids = np.zeros((sum(len(s) - 1 for s in sequences), run.logprobs.top_ids.shape[1]), dtype=np.int64)
    offset, start = 0, 0
    for prompt, generated in zip(prompt_lengths, run.lengths):
        ids[offset + prompt - 1:offset + prompt - 1 + generated] = run.logprobs.top_ids[start:start + generated]
        offset, start = offset + prompt + generated - 1, start + generated
    try:
        on_ids = engine.logprobs_on_ids(sequences, ids)
    except IdScoringUnavailable:
        return rows  # the KL partition falls back to the ids in this model's own top-k
    index = generated_index(prompt_lengths, run.lengths, len(on_ids))
    return dataclasses.replace(rows, logprobs_on_base_ids=on_ids[index])


def measure_model(engine: Engine, prompts: list[list[int]], spec: DecodeSpec, top_k: int, full_vocab: bool,
                  baseline: DecodeRun | None, layout: BatchLayout) -> DecodeResult:
    """One model's decode phase in its engine; ``baseline`` None measures the baseline itself."""
    own = write_continuations(engine, prompts, spec, top_k, full_vocab, layout)
    result = DecodeResult(own, score_by_prefill(engine, own, top_k, full_vocab, layout))
    if baseline is not None:
        result.on_baseline = score_by_prefill(engine, baseline, top_k, full_vocab, layout)
    return result
