"""JSON over HTTP(S) to one OpenAI-compatible server, with the gate's security rules.

Standard library only (no client package to pin). The API key comes from an
environment variable and lives only in request headers; every URL the gate
prints or stores goes through ``redact_url``; TLS certificates are verified
(urllib's default context); a redirect to another scheme, host or port is
refused rather than followed, so a key is never sent to a host nobody named.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from .errors import EndpointError, EndpointStatus

TIMEOUT_S = 600.0  # one request; a long prompt-logprob chunk on a CPU takes seconds


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


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the same scheme, host and port."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            raise EndpointError(f"{redact_url(req.full_url)} redirects to another origin "
                                f"({redact_url(newurl)}); the gate does not follow it")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class EndpointClient:
    """Requests to ``base_url`` (e.g. http://127.0.0.1:8000), authorised with the key in ``api_key_env``."""

    def __init__(self, base_url: str, api_key_env: str | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.shown = redact_url(self.base_url)
        self._headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise EndpointError(f"api_key_env: the environment variable {api_key_env} is not set or empty")
            self._headers["Authorization"] = f"Bearer {key}"
        self._opener = urllib.request.build_opener(_SameOriginRedirects())

    def _open(self, method: str, path: str, body: Any, timeout: float) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=self._headers)
        try:
            return self._opener.open(request, timeout=timeout)
        except urllib.error.HTTPError as err:
            raise EndpointStatus(f"HTTP {err.code}: {_detail(err)}", err.code) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            raise EndpointError(f"{self.shown}{path}: cannot connect: {reason}") from None

    def get(self, path: str, timeout: float = 30.0) -> Any:
        with self._open("GET", path, None, timeout) as response:
            return _json(response.read(), self.shown + path)

    def get_text(self, path: str, timeout: float = 30.0) -> str:
        with self._open("GET", path, None, timeout) as response:
            return str(response.read().decode("utf-8", errors="replace"))

    def post(self, path: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> Any:
        with self._open("POST", path, body, timeout) as response:
            return _json(response.read(), self.shown + path)

    def stream(self, path: str, body: dict[str, Any], timeout: float = TIMEOUT_S) -> Iterator[tuple[float, Any]]:
        """(perf_counter time, event) for each server-sent event of a streamed response."""
        with self._open("POST", path, body, timeout) as response:
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                yield time.perf_counter(), _json(payload.encode(), self.shown + path)


def _json(raw: bytes, where: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        raise EndpointError(f"{where}: the answer is not JSON: {raw[:200]!r}") from None


def _detail(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except ValueError:
        return str(err.reason)
    message = body.get("message") or body.get("error") or body.get("detail") or err.reason
    if isinstance(message, dict):
        message = message.get("message", message)
    return str(message)
