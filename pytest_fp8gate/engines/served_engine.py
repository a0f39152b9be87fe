"""The served edge: the ``Engine`` interface over a model behind a server, split as lm-eval's ``TemplateAPI``
splits its models. This class holds the transport and the flow of every pass: the server the gate starts
(managed) or is given (an endpoint), the HTTP client (``http_client``) and the one fan-out of requests
(``fan_out``), the local tokenizer, and how each pass turns into requests and back into the arrays measure,
gate and report read. A subclass speaks one server's API: its payloads, how its answers are parsed and the
probe that checks the server first (``vllm_served.VllmServedEngine``: vLLM's OpenAI-compatible server).

- prompt log-probs: one request per chunk, each answer read into arrays as it arrives;
- greedy generation and continuation log-probs (lm-eval's requests, through the gate's own ``EngineLM``, so
  BOS handling, stops and the samples files are the in-process gate's);
- the decode phase's continuations: the log-probs of each generated token, with the generated ids;
- a ``BatchLayout`` becomes order and concurrency: requests submitted in the layout's order (its ``stride``
  and ``reverse`` included, so each request's neighbours in the server's batches change), up to
  ``max_in_flight`` in flight, or calls of ``size`` concurrent requests;
- latency from streamed responses: time to the first token as the prefill, TPOT from the rest, so
  ``Latency.decode_tok_s`` is 1 / TPOT.

Tokens are cut by the local tokenizer of the served model (the probe checks that the server cuts them
alike), so every request carries token ids, as in-process.
"""

from __future__ import annotations

import abc
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np

from .. import checkpoint
from ..config.served import redact_url
from ..config.spec import LoadSpec, ModelSpec, ServedSpec
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..errors import EndpointError
from . import load
from .base import ALL_AT_ONCE, BatchLayout, Engine, Generation, Latency, timed_latency
from .capabilities import EngineCapabilities
from .endpoint_probe import ProbeResult
from .fan_out import fan_out
from .http_client import EndpointClient
from .server_process import ManagedServer

log = logging.getLogger("fp8gate")

T = TypeVar("T")
# Per-position arrays of one request (positions first..len-1): the real token's log-prob, the top-k ids and
# log-probs, and the whole vocabulary's log-probs where asked.
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, "np.ndarray | None"]


class ServedEngine(Engine):
    """A served model: a server the gate starts (managed) or an endpoint it is given (external), spoken to
    through the subclass's API."""

    startup_lines: tuple[str, ...] = ()  # a managed server's log up to healthy (startup_phases reads it)

    @classmethod
    def cache_settings(cls, spec: ModelSpec) -> dict[str, Any]:
        # The whole command line and environment change the numbers.
        return {"served": cache_key(spec.served)} if spec.served is not None else {}

    def __init__(self, spec: ModelSpec, *, max_logprobs: int, dtype: str | None = None) -> None:
        served = spec.served
        if served is None:
            raise ValueError(f"{spec.name}: no [served] settings")
        started = time.perf_counter()
        self.spec = spec
        self.served = served
        self.server: ManagedServer | None = None
        self.kwargs = _described(spec, dtype)  # for the provenance record: no key, no env values
        if served.managed:
            # The model's env is in os.environ now (Engine.applied_env): the server inherits it.
            self.server = ManagedServer(spec.name, _with_dtype(served.command, dtype), max_logprobs)
        try:
            self.tokenizer = _local_tokenizer(spec)  # while the server imports its engine and loads the weights
        except BaseException:
            self._stop_server()
            raise
        if self.server is not None:
            self.server.wait_healthy(served.health_timeout_s)  # stops the server when it never gets healthy
            self.startup_lines = tuple(self.server.log_text().splitlines())  # an endpoint's start is not seen
            url = self.server.url
        else:
            assert served.endpoint is not None
            url = served.endpoint
        try:
            self.client = EndpointClient(url, None if served.managed else served.api_key_env,
                                         served.request_deadline_s)
            self.where = f"{spec.name} at {self.client.shown}"
            self.probe = self._probe(max_logprobs)
        except BaseException:
            self._stop_server()
            raise
        self.capabilities = self._capabilities()
        self.vocab_size = self.probe.vocab_size or checkpoint.vocab_size_hint(spec.model)
        self.start_s = time.perf_counter() - started

    # ---- the server's API: what a subclass implements ------------------------

    @abc.abstractmethod
    def _probe(self, max_logprobs: int) -> ProbeResult:
        """Check the server before any measurement (model name, key, prompt log-probs of ``max_logprobs`` a
        position, tokenizer); raises EndpointError naming what it lacks."""

    @abc.abstractmethod
    def _capabilities(self) -> EngineCapabilities:
        """What the server can do, from the probe."""

    @abc.abstractmethod
    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        """The first choice of the greedy completion ``body`` asks for (a payload below, with the prompt)."""

    @abc.abstractmethod
    def _prompt_rows(self, prompt: Sequence[int], want: int) -> Any:
        """The prompt log-probs of ``prompt`` as the server gives them (one row a position), ``want`` ranked
        entries a position (-1: the whole vocabulary)."""

    @abc.abstractmethod
    def _rows_to_arrays(self, rows: list[Any], ids: Sequence[int], first: int, top_k: int,
                        vocab_size: int | None) -> Arrays:
        """Rows of log-probs (``rows[i]`` scores ``ids[i]``) as per-position arrays from position ``first``;
        ``vocab_size``: every row holds the whole vocabulary."""

    @abc.abstractmethod
    def _own_logprob(self, row: Any, token: int) -> tuple[float, bool]:
        """A row's log-prob of ``token`` and whether ``token`` ranks first there."""

    @abc.abstractmethod
    def _greedy_body(self, prompt: Sequence[int], max_tokens: int, stops: Sequence[str]) -> dict[str, Any]:
        """A greedy generation of up to ``max_tokens``, ended by a stop string, that reports its token ids."""

    @abc.abstractmethod
    def _decode_body(self, prompt: Sequence[int], max_tokens: int, want: int) -> dict[str, Any]:
        """A greedy continuation of exactly ``max_tokens`` with the ``want`` most likely log-probs of each
        generated token, keyed by token id, and the generated ids."""

    @abc.abstractmethod
    def _generated_rows(self, choice: dict[str, Any]) -> tuple[list[int], list[Any]]:
        """A ``_decode_body`` answer's generated ids and its log-probs as rows ``_rows_to_arrays`` reads."""

    @abc.abstractmethod
    def _stream_body(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        """A streamed completion of ``max_tokens`` tokens run to its full length, its token ids reported (speed
        and load add their sampling)."""

    # ---- facts -------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        if self.probe.max_model_len is None:
            raise EndpointError(f"{self.where}: /v1/models gives no max_model_len")
        return self.probe.max_model_len

    def facts(self) -> dict[str, Any]:
        return {"served_model_name": self.served.served_model_name, "endpoint": self.client.shown,
                "server_version": self.probe.version, "max_model_len": str(self.probe.max_model_len),
                "managed": self.served.managed, "prompt_logprobs_route": self.probe.prompt_route,
                "max_in_flight": self.served.max_in_flight}

    # ---- requests ----------------------------------------------------------

    def _completions(self, bodies: Sequence[dict[str, Any]], layout: BatchLayout) -> list[dict[str, Any]]:
        """The first choice of each request, sent in the layout's order and concurrency, in request order."""
        return fan_out(self.client, bodies, self._complete, self.served.max_in_flight, layout)

    def _prompt_answers(self, prompts: Sequence[Sequence[int]], want: int, layout: BatchLayout,
                        read: Callable[[int, list[Any]], T]) -> list[T]:
        """``read(i, rows)`` of each prompt's log-prob rows (``i``: its index), in request order; each answer
        is read as it arrives, so only the answers in flight are held as JSON."""
        def ask(at: int) -> T:
            prompt = prompts[at]
            rows = self._prompt_rows(prompt, want)
            if not isinstance(rows, list) or len(rows) != len(prompt):
                raise EndpointError(f"{self.where}: a request came back without prompt log-probs for its "
                                    f"{len(prompt)} prompt tokens")
            return read(at, rows)

        return fan_out(self.client, range(len(prompts)), ask, self.served.max_in_flight, layout)

    # ---- probabilities -----------------------------------------------------

    def prompt_logprobs(self, chunks: Sequence[Sequence[int]], top_k: int, full_vocab: bool,
                        layout: BatchLayout = ALL_AT_ONCE) -> LogprobRun:
        def convert(at: int, rows: list[Any]) -> Arrays:
            converting = time.perf_counter()
            arrays = self._rows_to_arrays(rows, chunks[at], 1, top_k, self.vocab_size if full_vocab else None)
            if self.client.clock is not None:
                self.client.clock.add("conversion to arrays", time.perf_counter() - converting)
            return arrays

        parts = self._prompt_answers(chunks, -1 if full_vocab else top_k, layout, convert)
        return LogprobRun(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                          np.concatenate([p[2] for p in parts]),
                          full_logprobs=np.concatenate([p[3] for p in parts]) if full_vocab else None,
                          token_ids=np.concatenate([np.asarray(c[1:], dtype=np.int64) for c in chunks]))

    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int, top_k: int,
                               full_vocab: bool, layout: BatchLayout = ALL_AT_ONCE
                               ) -> list[tuple[tuple[int, ...], LogprobRun]]:
        """Greedy continuations of ``max_tokens`` (every one its full length, as in-process) with the log-probs
        of each generated token; the whole vocabulary is asked for by its size."""
        want = self.vocab_size if full_vocab else top_k
        choices = self._completions([self._decode_body(p, max_tokens, want) for p in prompts], layout)
        results = []
        for choice in choices:
            ids, rows = self._generated_rows(choice)
            real, top_ids, top_lp, full = self._rows_to_arrays(rows, ids, 0, top_k,
                                                               self.vocab_size if full_vocab else None)
            results.append((tuple(ids), LogprobRun(real, top_ids, top_lp, full_logprobs=full,
                                                   token_ids=np.asarray(ids, dtype=np.int64))))
        return results

    # ---- generation --------------------------------------------------------

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                        stops: Sequence[Sequence[str]], layout: BatchLayout = ALL_AT_ONCE) -> list[Generation]:
        choices = self._completions([self._greedy_body(p, n, s) for p, n, s in zip(prompts, max_tokens, stops)],
                                    layout)
        # Servers without the generated ids: the text's ids (nothing the rules read).
        return [Generation(str(c.get("text", "")), tuple(c.get("token_ids") or self.encode(str(c.get("text", "")),
                                                                                            False)),
                           c.get("finish_reason"))
                for c in choices]

    def continuation_logprobs(self, prompts: Sequence[Sequence[int]], continuation_lengths: Sequence[int],
                              layout: BatchLayout = ALL_AT_ONCE) -> list[tuple[float, bool]]:
        def score(at: int, rows: list[Any]) -> tuple[float, bool]:
            prompt = prompts[at]
            found = [self._own_logprob(rows[i], prompt[i])
                     for i in range(len(prompt) - continuation_lengths[at], len(prompt))]
            return float(sum(value for value, _ in found)), all(first for _, first in found)

        return self._prompt_answers(prompts, 1, layout, score)

    # ---- speed -------------------------------------------------------------

    def latency(self, input_len: int, output_len: int, batch_size: int, warmup_iters: int, iters: int,
                min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
        """Streamed requests of random prompt ids (as in-process), ``batch_size`` at once: the median time to
        the last token is the total, the median time to the first token the prefill; as many iterations as
        base.timed_latency needs."""
        prompts = load.bench_prompt_ids(self.vocab_size, input_len, batch_size)

        def one(prompt: list[int]) -> tuple[float, float]:
            body = {**self._stream_body(prompt, output_len), "temperature": 1.0, "top_p": 1.0, "seed": 0}
            started, first, _, _ = load.streamed(self.client, body)
            return first - started, time.perf_counter() - started

        def timed() -> tuple[float, float]:
            times = fan_out(self.client, prompts, one, self.served.max_in_flight)
            return max(t[1] for t in times), max(t[0] for t in times)

        return timed_latency(timed, input_len, output_len, batch_size, warmup_iters, iters, min_iters,
                             target_rel_se)

    def load_levels(self, spec: LoadSpec, seed: int = 0) -> list[LoadLevel]:
        return load.measure_levels(self.client, self._stream_body, spec, self.vocab_size, seed)

    # ---- teardown ----------------------------------------------------------

    def shutdown(self) -> None:
        self._stop_server()
        log.info("fp8gate: done with served model %s", self.spec.name)

    def _stop_server(self) -> None:
        """Stop a managed server and copy its log into the output of the rule test that started it."""
        if self.server is None:
            return
        self.server.finish()
        self.server = None


def _local_tokenizer(spec: ModelSpec) -> Any:
    """The served model's tokenizer, loaded here (the probe checks the server's cuts text alike)."""
    from transformers import AutoTokenizer

    source = spec.engine.get("tokenizer") or spec.model
    try:
        return AutoTokenizer.from_pretrained(source, revision=spec.engine.get("revision"))
    except (OSError, ValueError) as err:
        raise EndpointError(f"{spec.name}: cannot load the tokenizer from {source}: {err}") from None


def _with_dtype(command: Sequence[str], dtype: str | None) -> list[str]:
    """The serve argv, with ``--dtype`` replaced for a precision noise pass (fp16, fp32)."""
    argv = list(command)
    if dtype is None:
        return argv
    for i, arg in enumerate(argv):
        if arg == "--dtype" and i + 1 < len(argv):
            return argv[:i] + argv[i + 2:] + ["--dtype", dtype]
        if arg.startswith("--dtype="):
            return argv[:i] + argv[i + 1:] + ["--dtype", dtype]
    return argv + ["--dtype", dtype]


def cache_key(served: ServedSpec) -> dict[str, Any]:
    """What of a served baseline keys the baseline cache besides its env (which the cache keys for
    every model): the command line, or the redacted endpoint and model name; and the requests in flight,
    which shape the server's batches."""
    return {"serve": list(served.command), "endpoint": redact_url(served.endpoint or ""),
            "served_model_name": served.served_model_name, "max_in_flight": served.max_in_flight}


def _described(spec: ModelSpec, dtype: str | None) -> dict[str, Any]:
    served = spec.served
    assert served is not None
    if served.managed:
        return {"serve": ["vllm", *_with_dtype(served.command, dtype)]}  # env: the run's own "env" record
    assert served.endpoint is not None
    return {"endpoint": redact_url(served.endpoint), "served_model_name": served.served_model_name,
            "api_key_env": served.api_key_env}
