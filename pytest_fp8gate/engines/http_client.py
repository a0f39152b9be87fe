"""JSON over HTTP(S) to one OpenAI-compatible server, with the gate's security rules.

Standard library only (no client package to pin). The API key comes from an
environment variable and lives only in request headers; every URL the gate
prints or stores goes through ``redact_url``; the known keys are blanked in
everything a server sends back (``blank_secrets``), so an error body that quotes
the Authorization header prints no key; TLS certificates are verified
(urllib's default context); a redirect to another scheme, host or port is
refused rather than followed, so a key is never sent to a host nobody named.

Every request has a whole-request deadline: a watchdog shuts its connection
down when the deadline passes, so a server that never answers, or drips one
byte at a time, ends in one ``EndpointTimeout`` naming the URL and the elapsed
time, however the bytes arrive (a socket timeout bounds only each read).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config.served import REQUEST_DEADLINE_S, redact_url
from ..errors import EndpointError, EndpointStatus, EndpointTimeout

SHORT_REQUEST_S = 30.0  # a GET of /v1/models, /version, /metrics or /health, capped by the deadline
SOCKET_SLACK_S = 1.0
BLANKED = "[key blanked]"
try:  # vLLM depends on msgspec; its decoder reads a log-prob answer several times faster than json's
    import msgspec

    _fast_decode: Any = msgspec.json.decode
    _FAST_ERRORS: tuple[type[Exception], ...] = (msgspec.DecodeError,)
except ImportError:  # an endpoint-only install without vLLM
    _fast_decode, _FAST_ERRORS = json.loads, ()
_secrets: set[str] = set()  # the keys of this process's endpoints, as given and as JSON escapes them
_secrets_lock = threading.Lock()


def remember_secret(value: str) -> None:
    """Blank ``value`` (an API key) in every later text a server sends back."""
    if value:
        with _secrets_lock:
            _secrets.update({value, json.dumps(value)[1:-1]})


def blank_secrets(text: str) -> str:
    """``text`` with every known key replaced by ``BLANKED``."""
    for secret in sorted(_secrets, key=len, reverse=True):
        text = text.replace(secret, BLANKED)
    return text


def _blanked(value: Any) -> Any:
    """A parsed JSON answer with the known keys blanked in its strings."""
    if isinstance(value, str):
        return blank_secrets(value)
    if isinstance(value, list):
        return [_blanked(item) for item in value]
    if isinstance(value, dict):
        return {key: _blanked(item) for key, item in value.items()}
    return value


class _SameOriginRedirects(urllib.request.HTTPRedirectHandler):
    """Follow a redirect only to the same scheme, host and port."""

    def redirect_request(self, req: Any, fp: Any, code: int, msg: str, headers: Any, newurl: str) -> Any:
        old, new = urllib.parse.urlsplit(req.full_url), urllib.parse.urlsplit(newurl)
        if (old.scheme, old.hostname, old.port) != (new.scheme, new.hostname, new.port):
            raise EndpointError(f"{redact_url(req.full_url)} redirects to another origin "
                                f"({redact_url(newurl)}); the gate does not follow it")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class _Watch:
    """One request's deadline: when it passes, every socket of the request is shut down, so the read
    blocked on it returns at once (a redirect's second connection included). The socket itself is kept:
    urllib drops the connection's reference once the headers are read, the response reads on."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()
        self.expired = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self.expire)
        self._timer.daemon = True
        self._timer.start()

    def connection_class(self, base: type[http.client.HTTPConnection]) -> type[http.client.HTTPConnection]:
        watch = self

        class Watched(base):  # type: ignore[valid-type, misc]
            def connect(self) -> None:
                super().connect()
                watch._attach(self.sock)

        return Watched

    def _attach(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)
            expired = self.expired
        if expired:
            _shut(sock)

    def expire(self) -> None:
        with self._lock:
            self.expired = True
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def cancel(self) -> None:
        self._timer.cancel()

    def elapsed(self) -> float:
        return time.monotonic() - self.started


def _shut(sock: socket.socket) -> None:
    # socket.socket's own shutdown, also for a TLS socket: it wakes the reader and leaves the TLS state alone.
    with contextlib.suppress(OSError, ValueError):
        socket.socket.shutdown(sock, socket.SHUT_RDWR)


class _WatchedHTTP(urllib.request.HTTPHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def http_open(self, req: Any) -> Any:
        return self.do_open(self.watch.connection_class(http.client.HTTPConnection), req)


class _WatchedHTTPS(urllib.request.HTTPSHandler):
    def __init__(self, watch: _Watch) -> None:
        super().__init__()
        self.watch = watch

    def https_open(self, req: Any) -> Any:
        return self.do_open(self.watch.connection_class(http.client.HTTPSConnection), req,
                            context=self._context)  # type: ignore[attr-defined]


@dataclass
class RequestClock:
    """Where the time of a client's POSTs goes, summed over requests (they overlap when several are in
    flight): sent until the answer's headers (the server computing and building its JSON: vLLM sends a
    non-streamed answer whole), headers until the last byte (transfer), and the client's JSON parse;
    ``add`` takes the caller's own steps (the log-prob pass's conversion to arrays)."""

    requests: int = 0
    bytes: int = 0
    max_in_flight: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    _in_flight: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, step: str, seconds: float) -> None:
        with self._lock:
            self.seconds[step] = self.seconds.get(step, 0.0) + seconds

    def add_bytes(self, count: int) -> None:
        with self._lock:
            self.bytes += count

    @contextlib.contextmanager
    def request(self) -> Iterator[None]:
        with self._lock:
            self.requests += 1
            self._in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
        try:
            yield
        finally:
            with self._lock:
                self._in_flight -= 1


class EndpointClient:
    """Requests to ``base_url`` (e.g. http://127.0.0.1:8000), authorised with the key in ``api_key_env``,
    each answered in full within ``deadline_s`` or given up."""

    def __init__(self, base_url: str, api_key_env: str | None = None,
                 deadline_s: float = REQUEST_DEADLINE_S) -> None:
        self.base_url = base_url.rstrip("/")
        self.shown = redact_url(self.base_url)
        self.deadline_s = deadline_s
        self._headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise EndpointError(f"api_key_env: the environment variable {api_key_env} is not set or empty")
            remember_secret(key)
            self._headers["Authorization"] = f"Bearer {key}"
        self._lock = threading.Lock()
        self._in_flight: set[_Watch] = set()
        self.clock: RequestClock | None = None  # set to split the POSTs' time (benchmarks/served_logprobs.py)

    def abort(self) -> None:
        """End every request in flight now (each raises EndpointTimeout): one failed, the rest are moot."""
        with self._lock:
            watches = list(self._in_flight)
        for watch in watches:
            watch.expire()

    @contextlib.contextmanager
    def _answer(self, method: str, path: str, body: Any, deadline_s: float) -> Iterator[Any]:
        """The open response, read by the caller inside the block; every failure one EndpointError."""
        where = self.shown + path
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method, headers=self._headers)
        watch = _Watch(deadline_s)
        with self._lock:
            self._in_flight.add(watch)
        opener = urllib.request.build_opener(_SameOriginRedirects(), _WatchedHTTP(watch), _WatchedHTTPS(watch))
        try:
            try:
                # Each socket operation may wait a little past the deadline: the watchdog, not a read's own
                # timeout, ends the request, so that a late answer is always named as one.
                response = opener.open(request, timeout=deadline_s + SOCKET_SLACK_S)
            except urllib.error.HTTPError as err:
                raise EndpointStatus(f"HTTP {err.code}: {_detail(err)}", err.code) from None
            except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
                reason = getattr(err, "reason", err)
                raise EndpointError(blank_secrets(f"{where}: cannot connect: {reason}")) from None
            with response:
                try:
                    yield response
                except (OSError, http.client.HTTPException) as err:
                    raise EndpointError(blank_secrets(f"{where}: the connection dropped mid-answer "
                                                      f"({type(err).__name__}: {err})")) from None
            watch.cancel()
            if watch.expired:  # a connection shut down mid-body can read as a short, clean end
                raise self._late(where, watch)
        except Exception as err:
            if watch.expired and not isinstance(err, EndpointTimeout):
                raise self._late(where, watch) from None
            raise
        finally:
            watch.cancel()
            with self._lock:
                self._in_flight.discard(watch)

    def _late(self, where: str, watch: _Watch) -> EndpointTimeout:
        return EndpointTimeout(f"{where}: no complete answer within the request deadline of {watch.seconds:g} s "
                               f"(request_deadline_s); gave up after {watch.elapsed():.1f} s")

    def get(self, path: str) -> Any:
        with self._answer("GET", path, None, min(SHORT_REQUEST_S, self.deadline_s)) as response:
            return _json(response.read(), self.shown + path)

    def get_text(self, path: str, deadline_s: float = SHORT_REQUEST_S) -> str:
        with self._answer("GET", path, None, min(deadline_s, self.deadline_s)) as response:
            return blank_secrets(response.read().decode("utf-8", errors="replace"))

    def post(self, path: str, body: dict[str, Any]) -> Any:
        clock = self.clock
        if clock is None:
            with self._answer("POST", path, body, self.deadline_s) as response:
                return _json(response.read(), self.shown + path)
        with clock.request():
            sent = time.perf_counter()
            with self._answer("POST", path, body, self.deadline_s) as response:
                headers = time.perf_counter()
                raw = response.read()
            read = time.perf_counter()
            value = _json(raw, self.shown + path)
            clock.add("server (to first byte)", headers - sent)
            clock.add("transfer", read - headers)
            clock.add("client JSON parse", time.perf_counter() - read)
            clock.add_bytes(len(raw))
            return value

    def stream(self, path: str, body: dict[str, Any]) -> Iterator[tuple[float, Any]]:
        """(perf_counter time, event) for each server-sent event of a streamed response, the whole stream
        within the deadline. An error event (vLLM's, sent when a request fails mid-stream) or a stream that
        ends without its closing ``[DONE]`` (the connection dropped) raises EndpointError."""
        where = self.shown + path
        with self._answer("POST", path, body, self.deadline_s) as response:
            for raw in response:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:"):].strip()
                if payload == "[DONE]":
                    return
                event = _json(payload.encode(), where)
                problem = _stream_error(event)
                if problem is not None:
                    raise EndpointError(f"{where}: the stream carried an error event: {problem}")
                yield time.perf_counter(), event
            raise EndpointError(f"{where}: the stream ended without its closing [DONE] (the connection "
                                "dropped mid-stream)")


def _stream_error(event: Any) -> str | None:
    """The message of an in-stream error event ({"error": {...}}, or an ErrorResponse with object "error")."""
    if not isinstance(event, dict):
        return None
    if "error" in event:
        error = event["error"]
        return str(error.get("message", error) if isinstance(error, dict) else error)
    if event.get("object") == "error":
        return str(event.get("message", event))
    return None


def _json(raw: bytes, where: str) -> Any:
    try:
        value = _decode(raw)
    except ValueError:
        raise EndpointError(blank_secrets(f"{where}: the answer is not JSON: {raw[:200]!r}")) from None
    with _secrets_lock:
        present = any(secret.encode() in raw for secret in _secrets)
    return _blanked(value) if present else value


def _decode(raw: bytes) -> Any:
    try:
        return _fast_decode(raw)
    except _FAST_ERRORS:  # what json reads and msgspec does not (NaN, Infinity), or not JSON at all
        return json.loads(raw)


def _detail(err: urllib.error.HTTPError) -> str:
    try:
        body = json.loads(err.read() or b"{}")
    except (ValueError, OSError, http.client.HTTPException):
        return blank_secrets(str(err.reason))
    finally:
        err.close()
    message = body.get("message") or body.get("error") or body.get("detail") or err.reason \
        if isinstance(body, dict) else err.reason
    if isinstance(message, dict):
        message = message.get("message", message)
    return blank_secrets(str(message))
