"""The OpenAI-compatible HTTP front door: stdlib HTTP over a small `Backend` interface.

Handler threads parse and check JSON, ask the backend to tokenize and validate (which must
not touch an engine), then relay the backend's Chunk stream as one JSON answer or as
server-sent events. They never hold an engine: the backend reaches the workers (Ray actors
behind the router, in `cluster/backend.py`).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param"}}`: 400 for a bad request
(naming `param`), 404 for an unknown route or model, 429 with Retry-After when the router's
queue is full, 503 with Retry-After when no worker of a needed role is alive or the server is
draining.
"""
from __future__ import annotations

import json
import socket
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Protocol

from engine.sampling import InvalidRequest, SamplingParams
from router.request_fields import SAMPLING_FIELDS, sampling_params, token_ids
from router.types import Chunk, NoWorker, Overloaded

MAX_BODY_BYTES = 16 << 20
RETRY_AFTER_S = 1  # what 429/503 answers suggest; the condition is usually brief


class Backend(Protocol):
    """What the front door needs from whatever runs the model."""

    model_name: str  # the id /v1/models lists and requests may name
    max_model_len: int

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a prompt; InvalidRequest (field "prompt") if it cannot be tokenized."""

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        """Messages through the chat template; InvalidRequest (field "messages") if malformed."""

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """InvalidRequest naming the field if the request can never run."""

    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 cache_salt: str | None = None) -> Iterator[Chunk]:
        """The request's chunks, the last one `finished`. A `cache_salt` shares cached prefixes
        only with requests of the same salt (a tenant's). Admission errors (Overloaded,
        NoWorker, InvalidRequest) come from the first next(). Closing the iterator before the
        last chunk aborts the request and frees its KV."""

    def health(self) -> tuple[bool, dict]:
        """(can serve now, details for /health)."""


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception from the backend."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, InvalidRequest):
        return ApiError(400, str(exc), exc.field)
    if isinstance(exc, Overloaded):
        return ApiError(429, str(exc), retry_after=RETRY_AFTER_S)
    if isinstance(exc, NoWorker):
        return ApiError(503, str(exc), retry_after=RETRY_AFTER_S)
    return ApiError(500, f"internal error: {exc}")


class ApiServer(ThreadingHTTPServer):
    """Binds at construction (so a taken port fails before anything slow starts); serves once
    `backend` is set and serve_forever() runs."""

    daemon_threads = True

    def __init__(self, host: str, port: int):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        super().__init__((host, port), Handler)
        self.backend: Backend | None = None
        self.draining = threading.Event()
        self._in_flight = 0
        self._idle = threading.Condition()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def track(self, delta: int) -> None:
        with self._idle:
            self._in_flight += delta
            if not self._in_flight:
                self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if `timeout_s` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout_s)


class Handler(BaseHTTPRequestHandler):
    server: ApiServer

    # -- routes ---------------------------------------------------------------------
    def do_GET(self) -> None:
        try:
            if self.path == "/health":
                self._health()
            elif self.path == "/v1/models":
                backend = self._backend()
                self._send(200, {"object": "list", "data": [{
                    "id": backend.model_name, "object": "model", "owned_by": "brigade",
                    "max_model_len": backend.max_model_len}]})
            else:
                raise ApiError(404, f"no route GET {self.path}; try /health, /v1/models")
        except Exception as exc:
            self._error(api_error(exc))

    def do_POST(self) -> None:
        if self.path != "/v1/completions":
            return self._error(ApiError(404, f"no route POST {self.path}; try POST /v1/completions"))
        self.server.track(+1)
        try:
            self._completion(self._body())
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client left before its answer
        except Exception as exc:
            error = api_error(exc)
            if error.status == 500:  # a bug: answer rather than drop the connection
                traceback.print_exc()
            self._error(error)
        finally:
            self.server.track(-1)

    # -- handlers -------------------------------------------------------------------
    def _backend(self) -> Backend:
        if self.server.draining.is_set():
            raise ApiError(503, "server is shutting down; retry on another replica", retry_after=RETRY_AFTER_S)
        if self.server.backend is None:
            raise ApiError(503, "server is starting; retry shortly", retry_after=RETRY_AFTER_S)
        return self.server.backend

    def _health(self) -> None:
        if self.server.draining.is_set():
            return self._send(503, {"status": "draining"}, retry_after=RETRY_AFTER_S)
        ok, details = self._backend().health()
        self._send(200 if ok else 503, {"status": "ok" if ok else "unavailable", **details},
                   retry_after=None if ok else RETRY_AFTER_S)

    def _body(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            raise ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _completion(self, body: dict) -> None:
        backend = self._backend()
        if body.get("model") not in (None, backend.model_name):
            raise ApiError(404, f"model {body['model']!r} is not served here; see /v1/models", "model")
        if body.get("n", 1) != 1:
            raise ApiError(400, "only n=1 is supported", "n")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if not isinstance(prompt, str):
            prompt = token_ids(prompt, "prompt")
        params = sampling_params(body, SamplingParams(), SAMPLING_FIELDS)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ApiError(400, f"cache_salt must be a non-empty string, got {salt!r:.80}", "cache_salt")
        ids = backend.tokenize(prompt)
        backend.validate(ids, params)

        rid = f"cmpl-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": backend.model_name}
        with_ids = body.get("return_token_ids") is True  # an extension (as in vLLM): the tokens, not only text
        with closing(backend.generate(rid, ids, params, cache_salt=salt)) as chunks:
            first = next(chunks)  # admission errors surface here, before any header is sent
            if not body.get("stream"):
                return self._whole(head, first, chunks, with_ids)
            self._stream(head, first, chunks, with_ids,
                         include_usage=bool((body.get("stream_options") or {}).get("include_usage")))

    def _whole(self, head: dict, first: Chunk, chunks: Iterator[Chunk], with_ids: bool) -> None:
        text, ids, last = [first.text], list(first.token_ids), first
        while not last.finished:
            last = next(chunks)
            text.append(last.text)
            ids += last.token_ids
        choice = _choice("".join(text), last.finish_reason, ids if with_ids else None)
        self._send(200, {**head, "choices": [choice], "usage": _usage(last)})

    def _stream(self, head: dict, first: Chunk, chunks: Iterator[Chunk], with_ids: bool, include_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        chunk = first
        try:
            while True:
                choice = _choice(chunk.text, chunk.finish_reason if chunk.finished else None,
                                 chunk.token_ids if with_ids else None)
                self._event({**head, "choices": [choice]})
                if chunk.finished:
                    break
                chunk = next(chunks)
            if include_usage:
                self._event({**head, "choices": [], "usage": _usage(chunk)})
            self.wfile.write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):
            raise  # do_POST ignores it; closing `chunks` aborts the request
        except Exception as exc:  # headers are out: report the failure in the stream
            error = api_error(exc)
            self._event({"error": {"message": str(error), "type": _error_type(error.status), "param": error.param}})

    # -- output ---------------------------------------------------------------------
    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _send(self, status: int, payload: dict, retry_after: int | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if retry_after is not None:
            self.send_header("Retry-After", str(retry_after))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: ApiError) -> None:
        try:
            self._send(exc.status, {"error": {"message": str(exc), "type": _error_type(exc.status),
                                              "param": exc.param}}, retry_after=exc.retry_after)
        except (BrokenPipeError, ConnectionResetError):
            pass


def _error_type(status: int) -> str:
    return {429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500 else "server_error")


def _choice(text: str, finish_reason: str | None, ids: list[int] | None) -> dict:
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if ids is not None:
        choice["token_ids"] = ids
    return choice


def _usage(chunk: Chunk) -> dict:
    u = chunk.usage
    if u is None:  # e.g. an aborted request's last chunk
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
