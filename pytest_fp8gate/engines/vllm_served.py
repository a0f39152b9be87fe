"""vLLM's OpenAI-compatible server as a served engine: ``vllm serve`` started by the gate, or an endpoint.

Its API is ``vllm_api``'s: the payloads (the completions API with vLLM's ``prompt_logprobs``,
``return_token_ids`` and ``return_tokens_as_token_ids``, and vLLM's token route for prompt log-probs),
the parsing of their JSON, and ``endpoint_probe``, which checks the server before any measurement.
KV capacity comes from the server's metrics, else from a managed server's log.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..config.spec import ModelSpec
from ..core import spec_decode
from ..errors import EndpointError, IdScoringUnavailable
from . import endpoint_probe, vllm_api, vllm_startup
from .base import vllm_refusal
from .capabilities import EngineCapabilities
from .endpoint_probe import ProbeResult
from .served_engine import Arrays, ServedEngine
from .vllm_engine import VllmEngine

NO_ID_SCORING = "the completions API takes no prompt_logprob_token_ids"
_KV_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


class VllmServedEngine(ServedEngine):
    """A model served by vLLM: a ``vllm serve`` the gate starts (managed) or an endpoint it is given."""

    @classmethod
    def prepare_process(cls, in_process: bool) -> None:
        # A managed vllm serve inherits the gate's environment, deterministic_scheduling's setting included.
        VllmEngine.prepare_process(in_process)

    @classmethod
    def refusal(cls, spec: ModelSpec, device: str) -> str | None:
        return vllm_refusal(spec, device)

    def startup_phases(self) -> dict[str, float]:
        """What the managed server's vLLM logged of its start (an endpoint's start is not seen)."""
        return vllm_startup.startup_phases(self.startup_lines)

    def kv_cache_tokens(self) -> int | None:
        tokens = endpoint_probe.kv_cache_tokens(self.client)
        if tokens is None and self.server is not None:
            found = _KV_LOG.findall(self.server.log_text())
            tokens = int(found[-1].replace(",", "")) if found else None
        return tokens

    def logprobs_on_ids(self, chunks: Sequence[Sequence[int]], ids: np.ndarray) -> np.ndarray:
        raise IdScoringUnavailable(NO_ID_SCORING)

    def spec_decode_reading(self) -> spec_decode.Reading:
        try:
            text = self.client.get_text("/metrics")
        except EndpointError as err:
            return spec_decode.Reading(None, missing=f"{self.where}: /metrics: {err}")
        reading = spec_decode.parse_metrics(text)
        return reading if reading.counts is not None else spec_decode.Reading(
            None, missing=f"{self.where}: {reading.missing}")

    # ---- the API -----------------------------------------------------------

    def _probe(self, max_logprobs: int) -> ProbeResult:
        return endpoint_probe.probe(self.client, self.spec.name, self.served.served_model_name,
                                    lambda text: list(self.tokenizer.encode(text)), max_logprobs)

    def _capabilities(self) -> EngineCapabilities:
        return EngineCapabilities(f"{self.probe.version} (served)", NO_ID_SCORING)

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        return vllm_api.completion(self.client, self.where,
                                   {"model": self.served.served_model_name, **vllm_api.GREEDY, **body})

    def _prompt_rows(self, prompt: Sequence[int], want: int) -> Any:
        return vllm_api.prompt_logprob_rows(self.client, self.where, self.probe.prompt_route,
                                            self.served.served_model_name, prompt, want)

    def _rows_to_arrays(self, rows: list[Any], ids: Sequence[int], first: int, top_k: int,
                        vocab_size: int | None) -> Arrays:
        return vllm_api.rows_to_arrays(self.where, rows, ids, first, top_k, vocab_size)

    def _own_logprob(self, row: Any, token: int) -> tuple[float, bool]:
        entry = vllm_api.entry(self.where, row, token)
        return vllm_api.logprob(entry), entry.get("rank") == 1

    def _greedy_body(self, prompt: Sequence[int], max_tokens: int, stops: Sequence[str]) -> dict[str, Any]:
        return {"prompt": list(prompt), "max_tokens": max_tokens, "stop": list(stops), "return_token_ids": True}

    def _decode_body(self, prompt: Sequence[int], max_tokens: int, want: int) -> dict[str, Any]:
        """The completions API's decode-time ``logprobs``, keyed by token id (``return_tokens_as_token_ids``),
        so no id is re-encoded from text. The whole vocabulary is asked for by its size, not -1: vLLM before
        PR #46175 refuses -1 there, and before #55717 answers it with empty top lists; a server that returns
        fewer entries is refused, never read as a bound. ``ignore_eos``: every continuation runs its length."""
        return {"prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, "logprobs": want,
                "return_token_ids": True, "return_tokens_as_token_ids": True}

    def _generated_rows(self, choice: dict[str, Any]) -> tuple[list[int], list[Any]]:
        return vllm_api.generated_rows(self.where, choice)

    def _stream_body(self, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
        return vllm_api.stream_body(self.served.served_model_name, prompt, max_tokens)
