"""vLLM's OpenAI-compatible API as the gate uses it: the requests it sends (payloads), the two routes to the
prompt log-probs, and how their JSON answers are read back into arrays (parsing).

- ``/v1/completions``: every OpenAI-compatible vLLM. Its front end detokenizes each entry of the prompt
  log-probs it returns (the top-k and the real token at every position), which on a 2,048-token chunk at
  top 20 is about 43,000 single-token decodes a request, in one Python process.
- ``/inference/v1/generate``: vLLM's token-in, token-out route (served by default by vLLM 0.26; vLLM 0.32
  serves it with ``--enable-scale-out``). It takes vLLM's own sampling parameters, so the gate asks as it
  does in-process, ``detokenize`` off: the same engine pass and the same numbers, without the decoding.

The probe picks the token route only where the server offers it and it scores the probe's tokens as the
completions API does (``endpoint_probe``); everything else keeps the completions API.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ..errors import EndpointError, EndpointStatus
from .http_client import EndpointClient

CLAMPED_LOGPROB = -9999.0  # vLLM's JSON stands this in for -inf
COMPLETIONS = "/v1/completions"
TOKEN_ROUTE = "/inference/v1/generate"
# Sampling fields a server's generation_config may default otherwise; greedy as in-process.
GREEDY = {"temperature": 0.0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
          "frequency_penalty": 0.0, "presence_penalty": 0.0}


def status_text(err: EndpointStatus) -> str:
    if err.status in (401, 403):
        return (f"HTTP {err.status}: the API key was refused (set the environment variable named by "
                f"api_key_env to the server's key)")
    return str(err)


def post(client: EndpointClient, where: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """A JSON object answered at ``path``; an error status becomes an EndpointError naming the path."""
    try:
        answer = client.post(path, body)
    except EndpointStatus as err:
        raise EndpointError(f"{where}: {path}: {status_text(err)}") from None
    if not isinstance(answer, dict):
        raise EndpointError(f"{where}: {path} answered {type(answer).__name__}, not a JSON object")
    return answer


def completion(client: EndpointClient, where: str, body: dict[str, Any]) -> dict[str, Any]:
    """The first choice of a /v1/completions answer; an error status becomes an EndpointError."""
    choices = post(client, where, COMPLETIONS, body).get("choices")
    if not choices:
        raise EndpointError(f"{where}: {COMPLETIONS} answered without choices")
    return dict(choices[0])


def prompt_logprob_rows(client: EndpointClient, where: str, route: str, model: str, ids: Sequence[int],
                        want: int) -> Any:
    """The prompt log-probs of ``ids`` as the server's JSON gives them (one row a position, keyed by token
    id, the first None), ``want`` ranked entries a position (-1: the whole vocabulary), by ``route``."""
    if route == TOKEN_ROUTE:
        params = {**GREEDY, "max_tokens": 1, "prompt_logprobs": want, "detokenize": False}
        return post(client, where, TOKEN_ROUTE, {"model": model, "token_ids": list(ids),
                                                 "sampling_params": params}).get("prompt_logprobs")
    return completion(client, where, {"model": model, **GREEDY, "prompt": list(ids), "max_tokens": 1,
                                      "prompt_logprobs": want}).get("prompt_logprobs")


def stream_body(model: str, prompt: Sequence[int], max_tokens: int) -> dict[str, Any]:
    """A streamed completion of ``max_tokens`` tokens that runs its full length (``ignore_eos``) and reports
    its token ids, so that each event's tokens are counted (the speed rule's and the load levels' requests;
    each adds its own sampling)."""
    return {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "return_token_ids": True}


# ---- parsing ----------------------------------------------------------------


def entry(where: str, row: Any, token: int) -> dict[str, Any]:
    entry = row.get(str(token)) if isinstance(row, dict) else None
    if not isinstance(entry, dict) or "logprob" not in entry:
        raise EndpointError(f"{where}: a position came back without its own token's log-prob")
    return entry


def logprob(entry: dict[str, Any]) -> float:
    value = float(entry["logprob"])
    return -np.inf if value <= CLAMPED_LOGPROB else value


def rows_to_arrays(where: str, rows: list[Any], ids: Sequence[int], first: int, top_k: int, vocab_size: int | None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """vLLM's JSON log-probs of one request (``rows[i]`` scores ``ids[i]``, as the prompt log-probs' entries
    do) -> per-position arrays (positions first..len-1), as vllm_engine._flat_to_arrays makes them from vLLM's
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


def generated_rows(where: str, choice: dict[str, Any]) -> tuple[list[int], list[dict[str, dict[str, Any]]]]:
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
