"""The served edge: the ``Engine`` interface over an OpenAI-compatible completions API.

Measure, gate and report see the same methods as for an in-process ``vllm.LLM``:

- prompt log-probs: vLLM's ``prompt_logprobs`` (top-k, or -1 for the full vocabulary) of the token ids,
  one request per chunk, through vLLM's token route where the server offers it (no detokenizing), else
  ``/v1/completions`` (``served_api``);
- greedy generation and continuation log-probs (lm-eval's requests, through the
  gate's own ``EngineLM``, so BOS handling, stops and the samples files are the
  in-process gate's);
- the decode phase's continuations: ``logprobs`` per generated token, keyed by
  token id, with the generated ids (``return_token_ids``);
- a ``BatchLayout`` becomes order and concurrency: requests submitted in the layout's
  order (its ``stride`` and ``reverse`` included, so each request's neighbours in the
  server's batches change), up to ``max_in_flight`` in flight, or calls of ``size``
  concurrent requests;
- latency from streamed responses: time to the first token as the prefill, TPOT from
  the rest, so ``Latency.decode_tok_s`` is 1 / TPOT;
- KV capacity from the server's metrics, else from a managed server's log.

Tokens are cut by the local tokenizer of the served model (the probe checks that
the server cuts them alike), so every request carries token ids, as in-process.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from .. import checkpoint, progress
from ..config.served import redact_url
from ..config.spec import LoadSpec, ModelSpec, ServedSpec
from ..core import spec_decode
from ..core.logprobs import LogprobRun
from ..core.rules import LoadLevel
from ..errors import EndpointError, IdScoringUnavailable
from . import endpoint_probe, load, served_api, vllm_startup
from .base import ALL_AT_ONCE, BatchLayout, Engine, Generation, Latency, timed_latency, vllm_refusal
from .capabilities import EngineCapabilities
from .http_client import EndpointClient
from .server_process import ManagedServer
from .vllm_engine import VllmEngine

log = logging.getLogger("fp8gate")

CLAMPED_LOGPROB = -9999.0  # vLLM's JSON stands this in for -inf
NO_ID_SCORING = "the completions API takes no prompt_logprob_token_ids"
_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")
T = TypeVar("T")


class ServedEngine(Engine):
    """A served model: a ``vllm serve`` the gate starts (managed) or an endpoint it is given (external)."""

    startup_lines: tuple[str, ...] = ()  # a managed server's log up to healthy (startup_phases reads it)

    @classmethod
    def prepare_process(cls, in_process: bool) -> None:
        # A managed vllm serve inherits the gate's environment, deterministic_scheduling's setting included.
        VllmEngine.prepare_process(in_process)

    @classmethod
    def refusal(cls, spec: ModelSpec, device: str) -> str | None:
        return vllm_refusal(spec, device)

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
            self.tokenizer = _local_tokenizer(spec)  # while the server imports vLLM and loads the weights
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
            self.probe = endpoint_probe.probe(self.client, spec.name, served.served_model_name,
                                              lambda text: list(self.tokenizer.encode(text)), max_logprobs)
        except BaseException:
            self._stop_server()
            raise
        self.capabilities = EngineCapabilities(f"{self.probe.version} (served)", NO_ID_SCORING)
        self.vocab_size = self.probe.vocab_size or checkpoint.vocab_size_hint(spec.model)
        self.start_s = time.perf_counter() - started

    def startup_phases(self) -> dict[str, float]:
        """What the managed server's vLLM logged of its start (an endpoint's start is not seen)."""
        return vllm_startup.startup_phases(self.startup_lines)

    # ---- facts -------------------------------------------------------------

    def kv_cache_tokens(self) -> int | None:
        tokens = endpoint_probe.kv_cache_tokens(self.client)
        if tokens is None and self.server is not None:
            found = _KV_LOG.findall(self.server.log_text())
            tokens = int(found[-1].replace(",", "")) if found else None
        return tokens

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
        base = {"model": self.served.served_model_name, **served_api.GREEDY}
        return _in_layout(layout, bodies, lambda body: served_api.completion(
            self.client, self.where, {**base, **body}), self.client, self.served.max_in_flight)

    def _prompt_answers(self, prompts: Sequence[Sequence[int]], want: int, layout: BatchLayout,
                        read: Callable[[int, list[Any]], T]) -> list[T]:
        """``read(i, rows)`` of each prompt's log-prob rows (``i``: its index), in request order; each answer
        is read as it arrives, so only the answers in flight are held as JSON."""
        def ask(at: int) -> T:
            prompt = prompts[at]
            rows = served_api.prompt_logprob_rows(self.client, self.where, self.probe.prompt_route,
                                                  self.served.served_model_name, prompt, want)
            if not isinstance(rows, list) or len(rows) != len(prompt):
                raise EndpointError(f"{self.where}: a request came back without prompt log-probs for its "
                                    f"{len(prompt)} prompt tokens")
            return read(at, rows)

        return _in_layout(layout, range(len(prompts)), ask, self.client, self.served.max_in_flight)

    # ---- probabilities -----------------------------------------------------

    def prompt_logprobs(self, chunks: Sequence[Sequence[int]], top_k: int, full_vocab: bool,
                        layout: BatchLayout = ALL_AT_ONCE) -> LogprobRun:
        def convert(at: int, rows: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
            converting = time.perf_counter()
            arrays = _rows_to_arrays(self.where, rows, chunks[at], 1, top_k, self.vocab_size if full_vocab else None)
            if self.client.clock is not None:
                self.client.clock.add("conversion to arrays", time.perf_counter() - converting)
            return arrays

        parts = self._prompt_answers(chunks, -1 if full_vocab else top_k, layout, convert)
        return LogprobRun(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                          np.concatenate([p[2] for p in parts]),
                          full_logprobs=np.concatenate([p[3] for p in parts]) if full_vocab else None,
                          token_ids=np.concatenate([np.asarray(c[1:], dtype=np.int64) for c in chunks]))

    def logprobs_on_ids(self, chunks: Sequence[Sequence[int]], ids: np.ndarray) -> np.ndarray:
        raise IdScoringUnavailable(NO_ID_SCORING)

    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int, top_k: int,
                               full_vocab: bool, layout: BatchLayout = ALL_AT_ONCE
                               ) -> list[tuple[tuple[int, ...], LogprobRun]]:
        """Greedy continuations with the completions API's decode-time ``logprobs``, keyed by token id
        (``return_tokens_as_token_ids``), so no id is re-encoded from text. The whole vocabulary is asked
        for by its size, not -1: vLLM before PR #46175 refuses -1 there, and before #55717 answers it with
        empty top lists; a server that returns fewer entries is refused, never read as a bound."""
        want = self.vocab_size if full_vocab else top_k
        # ignore_eos: every continuation runs its full length, as in-process.
        choices = self._completions([{"prompt": list(p), "max_tokens": max_tokens, "ignore_eos": True,
                                      "logprobs": want, "return_token_ids": True,
                                      "return_tokens_as_token_ids": True} for p in prompts], layout)
        results = []
        for choice in choices:
            ids, rows = _generated_rows(self.where, choice)
            real, top_ids, top_lp, full = _rows_to_arrays(self.where, rows, ids, 0, top_k,
                                                          self.vocab_size if full_vocab else None)
            results.append((tuple(ids), LogprobRun(real, top_ids, top_lp, full_logprobs=full,
                                                   token_ids=np.asarray(ids, dtype=np.int64))))
        return results

    # ---- generation --------------------------------------------------------

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                        stops: Sequence[Sequence[str]], layout: BatchLayout = ALL_AT_ONCE) -> list[Generation]:
        choices = self._completions([{"prompt": list(p), "max_tokens": n, "stop": list(s), "return_token_ids": True}
                                     for p, n, s in zip(prompts, max_tokens, stops)], layout)
        # Servers without return_token_ids: the text's ids (nothing the rules read).
        return [Generation(str(c.get("text", "")), tuple(c.get("token_ids") or self.encode(str(c.get("text", "")),
                                                                                            False)),
                           c.get("finish_reason"))
                for c in choices]

    def continuation_logprobs(self, prompts: Sequence[Sequence[int]], continuation_lengths: Sequence[int],
                              layout: BatchLayout = ALL_AT_ONCE) -> list[tuple[float, bool]]:
        def score(at: int, rows: list[Any]) -> tuple[float, bool]:
            prompt = prompts[at]
            entries = [_entry(self.where, rows[i], prompt[i])
                       for i in range(len(prompt) - continuation_lengths[at], len(prompt))]
            return float(sum(_logprob(e) for e in entries)), all(e.get("rank") == 1 for e in entries)

        return self._prompt_answers(prompts, 1, layout, score)

    # ---- speed -------------------------------------------------------------

    def latency(self, input_len: int, output_len: int, batch_size: int, warmup_iters: int, iters: int,
                min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
        """Streamed requests of random prompt ids (as in-process), ``batch_size`` at once: the median time to
        the last token is the total, the median time to the first token the prefill; as many iterations as
        engine.timed_latency needs."""
        prompts = load.bench_prompt_ids(self.vocab_size, input_len, batch_size)
        body = {"model": self.served.served_model_name, "max_tokens": output_len, "ignore_eos": True,
                "temperature": 1.0, "top_p": 1.0, "seed": 0, "stream": True, "return_token_ids": True}

        def one(prompt: list[int]) -> tuple[float, float]:
            started, first, _, _ = load.streamed(self.client, {**body, "prompt": prompt})
            return first - started, time.perf_counter() - started

        def timed() -> tuple[float, float]:
            times = _in_layout(ALL_AT_ONCE, prompts, one, self.client, self.served.max_in_flight)
            return max(t[1] for t in times), max(t[0] for t in times)

        return timed_latency(timed, input_len, output_len, batch_size, warmup_iters, iters, min_iters,
                             target_rel_se)

    def load_levels(self, spec: LoadSpec, seed: int = 0) -> list[LoadLevel]:
        return load.measure_levels(self.client, self.served.served_model_name, spec, self.vocab_size, seed)

    def spec_decode_reading(self) -> spec_decode.Reading:
        try:
            text = self.client.get_text("/metrics")
        except EndpointError as err:
            return spec_decode.Reading(None, missing=f"{self.where}: /metrics: {err}")
        reading = spec_decode.parse_metrics(text)
        return reading if reading.counts is not None else spec_decode.Reading(
            None, missing=f"{self.where}: {reading.missing}")

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


def _in_layout(layout: BatchLayout, items: Sequence[Any], send: Callable[[Any], T],
               client: EndpointClient, max_in_flight: int) -> list[T]:
    """``send`` each item: all at once (at most ``max_in_flight`` in flight) or in the layout's calls of ``size``
    concurrent requests; results in item order. The first failure ends the rest: those not sent are
    cancelled, those in flight at ``client`` aborted, so a hang costs one deadline, not one per request."""
    results: list[Any] = [None] * len(items)
    failed = threading.Event()

    def send_unless_failed(item: Any) -> T:
        # Set by the failing worker itself: the request it would pick up next is never sent.
        if failed.is_set():
            raise CancelledError
        try:
            result = send(item)
        except BaseException:
            failed.set()
            raise
        progress.advance()
        return result

    progress.expect(len(items))
    for batch in layout.batches(len(items)):
        with ThreadPoolExecutor(max_workers=max(1, min(len(batch), layout.size or max_in_flight))) as pool:
            futures = [pool.submit(send_unless_failed, items[i]) for i in batch]
            try:
                for i, future in zip(batch, futures):
                    results[i] = future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                client.abort()
                raise
    return results


def _entry(where: str, row: Any, token: int) -> dict[str, Any]:
    entry = row.get(str(token)) if isinstance(row, dict) else None
    if not isinstance(entry, dict) or "logprob" not in entry:
        raise EndpointError(f"{where}: a position came back without its own token's log-prob")
    return entry


def _logprob(entry: dict[str, Any]) -> float:
    value = float(entry["logprob"])
    return -np.inf if value <= CLAMPED_LOGPROB else value


def _rows_to_arrays(where: str, rows: list[Any], ids: Sequence[int], first: int, top_k: int, vocab_size: int | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """vLLM's JSON log-probs of one request (``rows[i]`` scores ``ids[i]``, as the prompt log-probs' entries
    do) -> per-position arrays (positions first..len-1), as engine._flat_to_arrays makes them from vLLM's
    FlatLogprobs. ``vocab_size``: every row must hold the whole vocabulary.

    vLLM's row holds the scored token and the ranked top ones, the scored token once when it is one of
    them: so it counts among the ranked only in a row no longer than what was asked, as in-process.
    One pass over the entries into flat arrays, then numpy (a Python sort per position cost seconds)."""
    picked = rows[first:len(ids)]
    count = len(picked)
    if not all(isinstance(row, dict) for row in picked):
        raise EndpointError(f"{where}: a position came back without its own token's log-prob")
    lengths = np.fromiter((len(row) for row in picked), np.int64, count)
    total = int(lengths.sum())
    entries = [entry for row in picked for entry in row.values()]
    try:
        tokens = np.fromiter((int(token) for row in picked for token in row), np.int64, total)
        ranks = np.fromiter((entry["rank"] for entry in entries), np.int64, total)
        logprobs = np.fromiter((entry["logprob"] for entry in entries), np.float64, total)
    except (KeyError, TypeError, ValueError):
        raise EndpointError(f"{where}: a log-prob entry without a token id, its logprob and rank") from None
    logprobs[logprobs <= CLAMPED_LOGPROB] = -np.inf
    row_of = np.repeat(np.arange(count), lengths)
    own = tokens == np.asarray(ids[first:], dtype=np.int64)[row_of]
    if not np.array_equal(np.bincount(row_of[own], minlength=count), np.ones(count, dtype=np.int64)):
        raise EndpointError(f"{where}: a position came back without its own token's log-prob")
    real = np.empty(count)
    real[row_of[own]] = logprobs[own]
    wanted = vocab_size or top_k
    if count and lengths.min() < wanted:
        raise EndpointError(f"{where}: {lengths.min()} log-probs at a position, fewer than the "
                            + (f"whole vocabulary's {vocab_size}" if vocab_size else f"top_k {top_k}"))
    ranked = ~own | (lengths <= wanted)[row_of]
    order = np.lexsort((ranks, row_of))  # stable: ties keep the server's order
    order = order[ranked[order]]
    rows_sorted = row_of[order]
    place = np.arange(len(order)) - np.searchsorted(rows_sorted, rows_sorted)
    if count and np.bincount(rows_sorted, minlength=count).min() < top_k:
        raise EndpointError(f"{where}: fewer than top_k {top_k} ranked log-probs at a position")
    kept = order[place < top_k]
    if (ranks[kept] > (place[place < top_k] + 1)).any():  # a slot filled from below the top: too few given
        raise EndpointError(f"{where}: fewer than top_k {top_k} ranked log-probs at a position")
    top_ids = tokens[kept].reshape(count, top_k)
    top_lp = logprobs[kept].reshape(count, top_k)
    full = None
    if vocab_size is not None:
        full = np.full((count, vocab_size), -np.inf, dtype=np.float32)
        full[row_of, tokens] = logprobs
    return real, top_ids, top_lp, full


def _generated_rows(where: str, choice: dict[str, Any]) -> tuple[list[int], list[dict[str, dict[str, Any]]]]:
    """A completion's generated ids and its ``logprobs.top_logprobs`` as prompt log-prob rows: keyed by
    id, ranked by log-prob (the completions API gives no ranks; vLLM lists them in rank order, which the
    stable sort keeps among ties)."""
    logprobs = choice.get("logprobs")
    tops = logprobs.get("top_logprobs") if isinstance(logprobs, dict) else None
    ids = choice.get("token_ids")
    if not isinstance(tops, list) or not isinstance(ids, list) or len(tops) != len(ids) or not ids:
        raise EndpointError(f"{where}: a completion came back without decode-time log-probs and token ids for "
                            "its generated tokens (the completions API's logprobs and return_token_ids)")
    rows = []
    for top in tops:
        if not isinstance(top, dict) or not all(str(key).startswith("token_id:") for key in top):
            raise EndpointError(f"{where}: decode-time log-probs not keyed by token id (the completions API's "
                                "return_tokens_as_token_ids)")
        ranked = sorted(top.items(), key=lambda item: -float(item[1]))
        rows.append({key.removeprefix("token_id:"): {"logprob": value, "rank": rank}
                     for rank, (key, value) in enumerate(ranked, 1)})
    return [int(i) for i in ids], rows


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
