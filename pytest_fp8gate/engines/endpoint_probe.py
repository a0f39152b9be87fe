"""What a served endpoint can do, checked before any measurement.

Each check that fails raises one ``EndpointError`` naming the model, the
(redacted) URL and the missing thing, so an endpoint that cannot be gated is
refused instead of measured: above all one that returns no prompt log-probs,
whose every probability and log-likelihood would otherwise be read as noise
(llama.cpp#27174: loglikelihood tasks silently scored at chance).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import EndpointError, EndpointStatus
from .http_client import EndpointClient

PROBE_TEXT = "The gate checks 12 + 30 = 42 before it measures.\nQuestion: what next?"
_KV_METRIC = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_MAX_ALLOWED = re.compile(r"max(?:imum)? allowed:? (-?\d+)", re.IGNORECASE)


@dataclass(frozen=True)
class ProbeResult:
    served_model_name: str
    version: str  # the server's /version, "unknown" where it has none
    max_model_len: int | None
    vocab_size: int | None  # entries of a full-vocabulary position; None unless asked for
    logprobs_per_position: int  # ranked entries the server returned per position (-1: all of them)


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
                       ranked if want == -1 else None, -1 if want == -1 else want)


def _models(client: EndpointClient, where: str) -> list[dict[str, Any]]:
    try:
        answer = client.get("/v1/models")
    except EndpointStatus as err:
        raise EndpointError(f"{where}: /v1/models: {_status_text(err)}") from None
    data = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(data, list):
        raise EndpointError(f"{where}: /v1/models has no model list; is this an OpenAI-compatible server?")
    return [m for m in data if isinstance(m, dict)]


def _status_text(err: EndpointStatus) -> str:
    if err.status in (401, 403):
        return (f"HTTP {err.status}: the API key was refused (set the environment variable named by "
                f"api_key_env to the server's key)")
    return str(err)


def completion(client: EndpointClient, where: str, body: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a /v1/completions answer; an error status becomes an EndpointError."""
    try:
        answer = client.post("/v1/completions", body)
    except EndpointStatus as err:
        raise EndpointError(f"{where}: /v1/completions: {_status_text(err)}") from None
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not choices:
        raise EndpointError(f"{where}: /v1/completions answered without choices")
    return dict(choices[0])


def _prompt_logprobs(client: EndpointClient, where: str, model: str, ids: Sequence[int],
                     want: int) -> list[dict[str, Any]]:
    body = {"model": model, "prompt": list(ids), "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": want}
    try:
        choice = completion(client, where, body)
    except EndpointError as err:
        allowed = _MAX_ALLOWED.search(str(err))
        if allowed:
            raise EndpointError(f"{where}: allows {allowed.group(1)} prompt log-probs per position, the gate "
                                f"needs {want} (vLLM's --max-logprobs)") from None
        raise
    rows = choice.get("prompt_logprobs")
    if not isinstance(rows, list) or len(rows) != len(ids) or not all(isinstance(r, dict) for r in rows[1:]):
        raise EndpointError(f"{where}: returns no prompt log-probs (the completions API's prompt_logprobs); "
                            "the probability check and log-likelihood tasks cannot be measured")
    return rows


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
