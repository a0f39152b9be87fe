"""A served model's settings that the loader checks: the endpoint URL, the request deadline, the
requests in flight, and the
`vllm serve` flags the gate sets itself. The engines (http_client, server_process) read the same
definitions, so the loader imports no engine module.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence

# The default whole-request deadline (request_deadline_s; docs/thresholds.md: its basis).
REQUEST_DEADLINE_S = 600.0
# The default requests in flight (max_in_flight) in a pass that sends all at once: as many as vLLM batches
# at once by default on the cards 8B-405B models are served on (max_num_seqs 1,024 on 70 GB+ cards, for
# `vllm serve` and vllm.LLM alike), so a served pass batches as the in-process one, which submits every
# request at once (an 8B model's 500 task generations: 1.3-1.5x the in-process pass at 1,024 on an H100,
# 1.6x at 256 on an H200, issue 33; the rest is the server's front end). A server with a smaller
# max_num_seqs queues the rest; an endpoint behind a proxy that limits connections needs a lower figure.
MAX_IN_FLIGHT = 1024
HOST = "127.0.0.1"  # the gate talks to its own server on loopback only
# Flags of `vllm serve` the gate sets itself, and why a user value cannot stand.
GATE_FLAGS = {
    "--port": "the gate picks a free port for each server it starts",
    "--host": f"the gate binds its own servers to {HOST}, so the model under test is not exposed",
    "--max-logprobs": "the gate sets it to what [probabilities] asks for (top_k, or -1 for the full "
                      "vocabulary); it only caps what a request may ask for, not what the model computes",
    "--api-key": "a key on the command line ends up in logs and artifacts; a server the gate starts needs none",
    "--uds": "the gate talks to its own servers over TCP on loopback",
}


def redact_url(url: str) -> str:
    """``url`` without user, password, query or fragment (any of them can carry a secret)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host + (f":{parts.port}" if parts.port else "")
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` cannot be an endpoint's base URL (the config error's second half); None if it can."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return f"expected an http:// or https:// URL with a host, got {redact_url(url)!r}"
    if parts.username is not None or parts.password is not None:
        return "credentials in the URL are refused (they would end up in logs); name the key's environment " \
               "variable in api_key_env"
    if parts.query or parts.fragment:
        return "expected a base URL without query or fragment"
    return None


def flag_conflict(argv: Sequence[str]) -> str | None:
    """The first gate-controlled flag in ``argv`` with the reason it is refused, or None."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in GATE_FLAGS:
            return f"{flag} is set by the gate ({GATE_FLAGS[flag]}); remove it"
    return None
