"""The requests the gate sends a served model, and the two routes to its prompt log-probs.

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

from ..errors import EndpointError, EndpointStatus
from .http_client import EndpointClient

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
