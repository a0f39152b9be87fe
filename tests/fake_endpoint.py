"""A stdlib HTTP server that answers like vLLM's OpenAI API, for the served engine's fault tests and the
load rule's engine-free tests.

Its knobs break one thing each (no prompt or decode-time log-probs, decode-time log-probs
other than prefill's, another model's prompt log-probs, a NaN, +inf or out-of-vocabulary runner-up,
another model name, a key,
a redirect to another host, a tokenizer that cuts text otherwise, a slower stream
or first token, streams one at a time, other weights behind the same name, requests never
answered, answers dripped a byte at a time, streams that fail, an error that quotes the
Authorization header, a speculator's acceptance, a restart that resets its counters); the measurements
themselves are tested against real ``vllm serve`` processes.
Every wait of a fault ends when the fake closes, or after ``HANG_S``.
Text prompts are cut by the embedded model's tokenizer, as the real server's.
"""

from __future__ import annotations

import json
import math
import re
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

VOCAB = 259
STREAM_TOKEN_S = 0.005  # between streamed tokens
HANG_S = 60.0  # the longest a never-answered request holds its thread
STREAM_FAULTS = ("abort", "error-event", "drop", "status")
TOKEN_ROUTE = "/inference/v1/generate"
SPEC_TOKENS = 3  # the fake speculator's num_speculative_tokens


def _logprob(rank: int, scale: float = 1.0) -> float:
    """Id ``rank`` of the fake's distribution, the same at every position: p(rank r) = (1 - e^-s) e^-(r s)
    sums to 1 over the vocabulary (to e^-(259 s)), so a full-vocabulary row is a distribution."""
    return math.log(1 - math.exp(-scale)) - rank * scale


@dataclass
class Knobs:
    model: str = "served-bf16"
    api_key: str | None = None  # required Bearer key, if set
    prompt_logprobs: bool = True  # False: answers without them, as servers without the vLLM extension do
    # Decode-time log-probs: False answers without them; a skew lowers the runner-up ids' log-probs while
    # decoding (not in prefill): a KV-cache path that only decode reads.
    sample_logprobs: bool = True
    decode_skew: float = 0.0
    max_logprobs: int = 20
    shifted_tokenizer: bool = False  # text prompts are cut into other ids than the local tokenizer's
    redirect_to: str | None = None  # every request is redirected there
    # Streaming: the gap between tokens (a slower build), and the wait before the first one (prefill).
    stream_token_s: float = STREAM_TOKEN_S
    first_token_s: float = 0.0
    kv_blocks: int = 64  # /metrics' vllm:cache_config_info, 16-token blocks
    serialized: bool = False  # streams one request at a time: a build that does not batch
    logprob_scale: float = 1.0  # the prompt log-probs' distribution (_logprob's scale): other weights
    hang_after: int | None = None  # completions after this many are never answered
    drip_s: float | None = None  # every answer's body is sent one byte this often
    # Every stream_fault_every-th stream fails: finish_reason "abort" after one token, vLLM's in-stream
    # error event, the connection closed after one token without [DONE], or HTTP 500.
    stream_fault: str | None = None
    stream_fault_every: int = 10
    # A speculator (vLLM's vllm:spec_decode_* counters on /metrics): each draft accepts this many tokens, so the
    # mean acceptance length is 1 + it; None: no speculative decoding, no counters. Idle: counters that never move.
    # Restart: every spec_restart_every-th /metrics read finds a new server (counters at 0, a new creation time).
    spec_accepted_per_draft: float | None = None
    spec_idle: bool = False
    spec_restart_every: int | None = None
    echo_authorization: bool = False  # completions answer 400, quoting the request's Authorization header
    tls: tuple[str, str] | None = None  # (certificate, key) files: serve HTTPS
    # Prompt log-probs that must not pass: another model's distribution (rank r on id (r + id_shift) mod VOCAB),
    # and the rank-2 entry's log-prob (NaN, +inf) or id (beyond the vocabulary) replaced at every position.
    id_shift: int = 0
    runner_up_logprob: float | None = None
    runner_up_id: int | None = None
    # A reasoning model: a generation (a request with stop strings) thinks this many characters after a
    # prompt that opens "<think>", closes the block and answers the prompt's last number, within max_tokens.
    think: int | None = None
    # vLLM's token route (/inference/v1/generate, token ids and sampling_params in, prompt log-probs out),
    # which vLLM 0.26 serves by default; token_route_scale: it answers another distribution than completions.
    token_route: bool = False
    token_route_scale: float | None = None
    requests: list[str] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    prompts: list[list[int]] = field(default_factory=list)  # every completion's prompt ids


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    from pytest_fp8gate.tools.demo.embedded import embedded_assets

    return AutoTokenizer.from_pretrained(str(embedded_assets().model))


class FakeEndpoint:
    """``with FakeEndpoint(Knobs(...)) as url:`` serves on 127.0.0.1 until the block ends."""

    def __init__(self, knobs: Knobs) -> None:
        assert knobs.stream_fault in (None, *STREAM_FAULTS), knobs.stream_fault
        self.knobs = knobs
        self.one_at_a_time = threading.Lock()  # held while streaming, with Knobs.serialized
        self.counting = threading.Lock()
        self.completions = self.streams = self.metrics_reads = 0
        self.spec = {"drafts": 0.0, "draft_tokens": 0.0, "accepted_tokens": 0.0}
        self.spec_created = 1.7e9
        self.closing = threading.Event()  # set on leaving: every hung request ends
        self.hung_at: list[float] = []  # time.monotonic() of each request left unanswered
        self.tokenizer = _tokenizer()
        handler = type("Handler", (_Handler,), {"endpoint": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        scheme = "http"
        if knobs.tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*knobs.tls)
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            scheme = "https"
        self.url = f"{scheme}://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> str:
        # serve_forever's default half-second poll made shutdown() wait up to that long: half a second of
        # nothing for each endpoint of each test.
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True).start()
        return self.url

    def __exit__(self, *exc: object) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()

    def prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt))
            return [(i + 1) % VOCAB for i in ids] if self.knobs.shifted_tokenizer else ids
        return list(prompt)

    def speculate(self, tokens: int) -> None:
        """Count the drafts of a completion of ``tokens`` tokens: each verification step after the first token
        yields 1 + spec_accepted_per_draft of them, from a draft of SPEC_TOKENS."""
        accepted = self.knobs.spec_accepted_per_draft
        if accepted is None or self.knobs.spec_idle or tokens < 2:
            return
        drafts = (tokens - 1) / (1 + accepted)
        with self.counting:
            self.spec["drafts"] += drafts
            self.spec["draft_tokens"] += SPEC_TOKENS * drafts
            self.spec["accepted_tokens"] += accepted * drafts

    def metrics(self) -> str:
        knobs = self.knobs
        lines = [f'vllm:cache_config_info{{block_size="16",num_gpu_blocks="{knobs.kv_blocks}"}} 1.0']
        with self.counting:
            self.metrics_reads += 1
            if knobs.spec_restart_every and self.metrics_reads % knobs.spec_restart_every == 0:
                self.spec = dict.fromkeys(self.spec, 0.0)
                self.spec_created += 100.0
            if knobs.spec_accepted_per_draft is not None:
                for name, value in self.spec.items():
                    metric = f"vllm:spec_decode_num_{name}"
                    lines += [f"# TYPE {metric}_total counter",
                              f'{metric}_total{{engine="0",model_name="{knobs.model}"}} {value!r}',
                              f'{metric}_created{{engine="0",model_name="{knobs.model}"}} {self.spec_created!r}']
        return "\n".join(lines) + "\n"

    def completion(self, body: dict[str, Any], scale: float | None = None) -> tuple[int, dict[str, Any]]:
        if body.get("model") != self.knobs.model:
            return 404, {"error": {"message": f"The model `{body.get('model')}` does not exist."}}
        ids = self.prompt_ids(body["prompt"])
        self.knobs.prompts.append(ids)
        choice: dict[str, Any] = {"index": 0, "text": " 42", "finish_reason": "length"}
        if self.knobs.think is not None and "stop" in body:
            choice = self._thought(ids, int(body.get("max_tokens", 16)))
            return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.knobs.model,
                         "choices": [choice]}
        want = body.get("prompt_logprobs")
        if want is not None and self.knobs.prompt_logprobs:
            count = VOCAB if want == -1 else want
            if count > self.knobs.max_logprobs and self.knobs.max_logprobs != -1:
                return 400, {"error": {"message": f"Requested prompt logprobs of {count}, which is greater than "
                                                  f"max allowed: {self.knobs.max_logprobs}"}}
            scale = scale or self.knobs.logprob_scale
            choice["prompt_logprobs"] = [None] + [self._prompt_row(token, count, scale) for token in ids[1:]]
        want = body.get("logprobs")
        if want is not None:
            count = VOCAB if want == -1 else want
            if count > self.knobs.max_logprobs and self.knobs.max_logprobs != -1:
                return 400, {"error": {"message": f"Requested sample logprobs of {count}, which is greater than "
                                                  f"max allowed: {self.knobs.max_logprobs}"}}
            self._decode(choice, int(body.get("max_tokens", 16)), count, bool(body.get("return_tokens_as_token_ids")))
        if body.get("return_token_ids"):
            choice["token_ids"] = [0] * int(body.get("max_tokens", 16))  # what _decode writes: id 0, greedily
        self.speculate(int(body.get("max_tokens", 16)))
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.knobs.model, "choices": [choice]}

    def generate(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """The token route: the completions answer of the same ids and parameters, in its shape (prompt
        log-probs at the top level, no text)."""
        params = body.get("sampling_params") or {}
        if params.get("detokenize", True):
            return 400, {"error": {"message": "the fake's token route only answers detokenize false"}}
        request = {"model": body.get("model"), "prompt": body.get("token_ids"),
                   **{k: params[k] for k in ("max_tokens", "prompt_logprobs") if k in params}}
        status, answer = self.completion(request, self.knobs.token_route_scale)
        if status != 200:
            return status, answer
        choice = answer["choices"][0]
        return 200, {"request_id": "generate-tokens-fake", "model": self.knobs.model,
                     "choices": [{"index": 0, "token_ids": [0], "finish_reason": "length"}],
                     "prompt_logprobs": choice.get("prompt_logprobs")}

    def _thought(self, ids: list[int], max_tokens: int) -> dict[str, Any]:
        """A reasoning model's answer: thinking (with the stop strings a task sets inside it) if the prompt
        opens a thinking block, then the prompt's last number; cut at max_tokens ("length")."""
        prompt = self.tokenizer.decode(ids)
        number = re.findall(r"\d+", prompt)[-1]
        think = self.knobs.think or 0
        thinking = ("Question: which? Hmm.\n\n" * (think // 8 + 1))[:think] + "</think>" \
            if prompt.endswith("<think>") else ""
        answer = list(self.tokenizer.encode(f"{thinking} The number is {number}.\n#### {number}",
                                            add_special_tokens=False))
        cut = answer[:max_tokens]
        return {"index": 0, "text": self.tokenizer.decode(cut), "token_ids": cut,
                "finish_reason": "length" if len(answer) > max_tokens else "stop"}

    def _prompt_row(self, token: int, count: int, scale: float) -> dict[str, Any]:
        """One position's prompt log-probs: the real token's entry and the top ``count``, keyed by id."""
        knobs = self.knobs
        rank_of = (token - knobs.id_shift) % VOCAB
        ranked = [((r + knobs.id_shift) % VOCAB, _logprob(r, scale)) for r in range(count)]
        if count > 1 and knobs.runner_up_logprob is not None:
            ranked[1] = (ranked[1][0], knobs.runner_up_logprob)
        if count > 1 and knobs.runner_up_id is not None:
            ranked[1] = (knobs.runner_up_id, ranked[1][1])
        row = {str(token): {"logprob": _logprob(rank_of, scale), "rank": 1 + rank_of}}
        row.update({str(t): {"logprob": lp, "rank": r + 1} for r, (t, lp) in enumerate(ranked)})
        return row

    def _decode(self, choice: dict[str, Any], tokens: int, count: int, as_ids: bool) -> None:
        """vLLM's completions ``logprobs``: per generated token its log-prob and a dict of the sampled token
        and the top ``count``, keyed "token_id:N" with return_tokens_as_token_ids (else by text), -inf as
        -9999.0. The distribution is the prompt log-probs' (every position alike), so id 0 is the greedy
        choice; ``decode_skew`` sharpens it while decoding."""
        if not self.knobs.sample_logprobs:
            return
        scale = 1.0 + self.knobs.decode_skew
        top = {(f"token_id:{t}" if as_ids else self.tokenizer.decode([t])): max(_logprob(r, scale), -9999.0)
               for r, t in enumerate(range(count))}
        choice["logprobs"] = {"text_offset": list(range(tokens)), "token_logprobs": [_logprob(0, scale)] * tokens,
                              "tokens": ["token_id:0" if as_ids else self.tokenizer.decode([0])] * tokens,
                              "top_logprobs": [dict(top) for _ in range(tokens)]}


class _Handler(BaseHTTPRequestHandler):
    endpoint: FakeEndpoint

    def log_message(self, format: str, *args: Any) -> None:  # keep the test output clean
        pass

    def _answer(self, status: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        drip = self.endpoint.knobs.drip_s
        if drip is None:
            self.wfile.write(data)
            return
        for i in range(len(data)):  # a byte at a time, until the client gives up or the fake closes
            if self.endpoint.closing.wait(drip):
                return
            try:
                self.wfile.write(data[i:i + 1])
                self.wfile.flush()
            except OSError:
                return

    def _gatekeeper(self) -> bool:
        knobs = self.endpoint.knobs
        knobs.requests.append(self.path)
        knobs.headers.append(dict(self.headers))
        if knobs.redirect_to is not None:
            self.send_response(302)
            self.send_header("Location", knobs.redirect_to + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return False
        if knobs.api_key is not None and self.headers.get("Authorization") != f"Bearer {knobs.api_key}":
            self._answer(401, {"error": "Unauthorized"})
            return False
        return True

    def do_GET(self) -> None:
        if not self._gatekeeper():
            return
        if self.path == "/health":
            self._answer(200, {})
        elif self.path == "/v1/models":
            self._answer(200, {"object": "list", "data": [{"id": self.endpoint.knobs.model, "max_model_len": 2048}]})
        elif self.path == "/version":
            self._answer(200, {"version": "0.0.0-fake"})
        elif self.path == "/metrics":
            data = self.endpoint.metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        else:
            self._answer(404, {"error": "not found"})

    def do_POST(self) -> None:
        if not self._gatekeeper():
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        endpoint, knobs = self.endpoint, self.endpoint.knobs
        if self.path != "/v1/completions" and (self.path != TOKEN_ROUTE or not knobs.token_route):
            self._answer(404, {"error": "not found"})
            return
        with endpoint.counting:
            endpoint.completions += 1
            answered = knobs.hang_after is None or endpoint.completions <= knobs.hang_after
        if not answered:
            endpoint.hung_at.append(time.monotonic())
            endpoint.closing.wait(HANG_S)
            return
        if knobs.echo_authorization:
            self._answer(400, {"error": {"message": f"malformed request (headers: Authorization: "
                                                    f"{self.headers.get('Authorization')})"}})
            return
        if body.get("stream"):
            with endpoint.counting:
                endpoint.streams += 1
                fault = knobs.stream_fault if endpoint.streams % knobs.stream_fault_every == 0 else None
            if knobs.serialized:
                with endpoint.one_at_a_time:
                    self._stream(int(body.get("max_tokens", 16)), fault)
            else:
                self._stream(int(body.get("max_tokens", 16)), fault)
            return
        self._answer(*(endpoint.completion(body) if self.path == "/v1/completions" else endpoint.generate(body)))

    def _stream(self, tokens: int, fault: str | None) -> None:
        """One server-sent event a token, ``stream_token_s`` apart (after ``first_token_s``), the last with
        finish_reason "length", then [DONE]; or the stream ``fault``."""
        knobs = self.endpoint.knobs
        if fault == "status":
            self._answer(500, {"error": {"message": "EngineCore encountered an issue"}})
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        time.sleep(knobs.first_token_s)
        if not fault:
            self.endpoint.speculate(tokens)
        for i in range(1 if fault else tokens):
            time.sleep(knobs.stream_token_s)
            finish = "length" if i == tokens - 1 else None
            self._event({"choices": [{"index": 0, "text": "x", "token_ids": [120], "finish_reason": finish}]})
        if fault == "drop":
            return  # the connection closes without [DONE]
        if fault == "abort":
            self._event({"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "abort"}]})
        elif fault == "error-event":  # vLLM's: an ErrorResponse as one event, then [DONE]
            self._event({"error": {"message": "the engine core died mid-request", "type": "InternalServerError",
                                   "param": None, "code": 500}})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, event: dict[str, Any]) -> None:
        self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        self.wfile.flush()
