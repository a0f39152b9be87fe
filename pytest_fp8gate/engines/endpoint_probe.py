"""What a served endpoint can do, checked before any measurement.

Each check that fails raises one ``EndpointError`` naming the model, the
(redacted) URL and the missing thing, so an endpoint that cannot be gated is
refused instead of measured: above all one that returns no prompt log-probs,
whose every probability and log-likelihood would otherwise be read as noise
(llama.cpp#27174: loglikelihood tasks silently scored at chance).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import EndpointError, EndpointStatus
from .http_client import EndpointClient
from .vllm_api import COMPLETIONS, TOKEN_ROUTE, completion, prompt_logprob_rows, status_text

log = logging.getLogger("fp8gate")

PROBE_TEXT = "The gate checks 12 + 30 = 42 before it measures.\nQuestion: what next?"
_KV_METRIC = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_MAX_ALLOWED = re.compile(r"max(?:imum)? allowed:? (-?\d+)", re.IGNORECASE)
# The token route must score the probe's tokens as the completions API does: the same engine pass (the
# in-process pass and the completions API agree exactly on one request), so any gap is another server.
ROUTE_AGREEMENT = 1e-3  # nats, per position


@dataclass(frozen=True)
class ProbeResult:
    served_model_name: str
    version: str  # the server's /version, "unknown" where it has none
    max_model_len: int | None
    vocab_size: int | None  # entries of a full-vocabulary position; None unless asked for
    logprobs_per_position: int  # ranked entries the server returned per position (-1: all of them)
    prompt_route: str = COMPLETIONS  # where the prompt log-probs are asked (vllm_api)


def probe(client: EndpointClient, label: str, served_model_name: str, tokenize: Callable[[str], list[int]],
          want_logprobs: int) -> ProbeResult:
    """Check model name, key, prompt log-probs (``want_logprobs`` per position, -1 for all) and tokenizer.

    ``tokenize``: the local tokenizer on text, special tokens added as the server adds them to a text prompt.
    """
    where = f"{label} at {client.shown}"
    models = _models(client, where)
    names = [str(m.get("id")) for m in models]
    if served_model_name not in names:
        raise EndpointError(f"{where}: serves {', '.join(names) or 'no model'}, not {served_model_name!r} "
                            "(served_model_name, or --served-model-name of the serve command)")
    card = models[names.index(served_model_name)]
    ids = tokenize(PROBE_TEXT)
    want = want_logprobs if want_logprobs != 0 else 1
    rows = _prompt_logprobs(client, where, served_model_name, ids, want)
    widths = {len(row) for row in rows[1:]}
    ranked = min(widths) if widths else 0
    needed = 1 if want == -1 else want
    if ranked < needed:
        raise EndpointError(f"{where}: returns {ranked} prompt log-probs per position, the gate asked for {want} "
                            "(the server caps them: vLLM's --max-logprobs)")
    _check_tokenizer(client, where, served_model_name, ids)
    return ProbeResult(served_model_name, _version(client), _int(card.get("max_model_len")),
                       ranked if want == -1 else None, -1 if want == -1 else want,
                       _prompt_route(client, where, served_model_name, ids, want, rows))


def _models(client: EndpointClient, where: str) -> list[dict[str, Any]]:
    try:
        answer = client.get("/v1/models")
    except EndpointStatus as err:
        raise EndpointError(f"{where}: /v1/models: {status_text(err)}") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise EndpointError(f"{where}: /v1/models has no model list; is this an OpenAI-compatible server?")
    return [m for m in data if isinstance(m, dict)]


def _prompt_logprobs(client: EndpointClient, where: str, model: str, ids: Sequence[int],
                     want: int) -> list[dict[str, Any]]:
    try:
        rows = prompt_logprob_rows(client, where, COMPLETIONS, model, ids, want)
    except EndpointError as err:
        allowed = _MAX_ALLOWED.search(str(err))
        if allowed:
            raise EndpointError(f"{where}: allows {allowed.group(1)} prompt log-probs per position, the gate "
                                f"needs {want} (vLLM's --max-logprobs)") from None
        raise
    if not isinstance(rows, list) or len(rows) != len(ids) or not all(isinstance(r, dict) for r in rows[1:]):
        raise EndpointError(f"{where}: returns no prompt log-probs (the completions API's prompt_logprobs); "
                            "the probability check and log-likelihood tasks cannot be measured")
    return rows


def _prompt_route(client: EndpointClient, where: str, model: str, ids: Sequence[int], want: int,
                  completions_rows: list[dict[str, Any]]) -> str:
    """TOKEN_ROUTE where the server offers it and it scores every probe token within ROUTE_AGREEMENT of
    the completions API, else COMPLETIONS (a server without the route answers 404)."""
    try:
        rows = prompt_logprob_rows(client, where, TOKEN_ROUTE, model, ids, want)
    except EndpointError as err:
        log.info("fp8gate: %s: prompt log-probs through %s (%s: %s)", where, COMPLETIONS, TOKEN_ROUTE, err)
        return COMPLETIONS
    if not isinstance(rows, list) or len(rows) != len(ids) or not all(
            _real_gap(token, a, b) <= ROUTE_AGREEMENT for token, a, b in zip(ids[1:], completions_rows[1:], rows[1:])):
        log.warning("fp8gate: %s: %s scores the probe's tokens otherwise than %s; using %s", where, TOKEN_ROUTE,
                    COMPLETIONS, COMPLETIONS)
        return COMPLETIONS
    return TOKEN_ROUTE


def _real_gap(token: int, completions_row: Any, route_row: Any) -> float:
    """|difference| of the two rows' log-probs of the position's own token (inf where either lacks it)."""
    try:
        return abs(float(completions_row[str(token)]["logprob"]) - float(route_row[str(token)]["logprob"]))
    except (KeyError, TypeError, ValueError):
        return float("inf")


def _check_tokenizer(client: EndpointClient, where: str, model: str, ids: Sequence[int]) -> None:
    """The server must cut the probe text into the ids the local tokenizer gives (special tokens included)."""
    body = {"model": model, "prompt": PROBE_TEXT, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}
    rows = completion(client, where, body).get("prompt_logprobs") or []
    served = [next(iter(row)) if isinstance(row, dict) and row else None for row in rows[1:]]
    if len(rows) != len(ids) or [str(i) for i in ids[1:]] != served:
        raise EndpointError(f"{where}: its tokenizer cuts a probe text into {len(rows)} tokens, the local "
                            f"tokenizer into {len(ids)} (or into other ids); the local tokenizer must be the "
                            "served model's")


def _version(client: EndpointClient) -> str:
    try:
        answer = client.get("/version")
    except EndpointError:
        return "unknown"
    return str(answer.get("version", "unknown")) if isinstance(answer, dict) else "unknown"


def kv_cache_tokens(client: EndpointClient) -> int | None:
    """KV capacity in tokens from the server's Prometheus metrics (vLLM's cache_config_info)."""
    try:
        text = client.get_text("/metrics")
    except EndpointError:
        return None
    match = _KV_METRIC.search(text)
    if match is None:
        return None
    labels = dict(_LABEL.findall(match.group(1)))
    blocks, size = _int(labels.get("num_gpu_blocks")), _int(labels.get("block_size"))
    return blocks * size if blocks and size else None


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
