"""The OpenAI-compatible HTTP front door: stdlib HTTP over the doors' `Backend` (router/backend.py).

Handler threads check auth, parse and check JSON (router/http/openai_format.py), ask the backend
to tokenize and validate (which must not touch an engine), build the GenerateRequest, then
relay the backend's async Chunk stream (through the server's own loop thread,
router/http/bridge.py) as one JSON answer or as server-sent events. They never hold an
engine: the backend reaches the workers (Ray actors behind the router, in `cluster/backend.py`).

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}`, with the status
of router/errors.py's table: 400 for a bad request (naming `param`), 404 for another model,
429 with Retry-After when the router's queue is full, 503 with Retry-After when no worker of a
needed role is alive; and the door's own: 401 with `WWW-Authenticate: Bearer` without a known
token, 404 for an unknown route, 413 for a body over `frontdoor.max_message_bytes`, 503 while
starting or draining.

Auth (when tokens are configured) covers every route, /metrics included (Prometheus sends
the token with `authorization: {credentials_file: ...}`), except /health while
`auth.public_health` (probes carry no secrets). The token's tenant is the request's cache
salt (router.auth.cache_salt). Each generation request (POST) is recorded in the shared
FrontDoorMetrics under door="http"; a client that leaves mid-stream is "cancelled", and
closing the backend's stream aborts its work and frees its KV.
"""
from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import closing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from engine.messages import Chunk, GenerateRequest
from engine.sampling import InvalidRequest
from router import errors
from router.auth import DEFAULT_TENANT, Authenticator, cache_salt
from router.backend import Backend
from router.config import FrontDoorConfig
from router.errors import ModelNotFound
from router.http.bridge import LoopThread
from router.http.guards import ConnectionCap, Deadlines, readable, refuse
from router.http.openai_format import ChatShape, Collected, CompletionShape, parse_chat, parse_completion
from router.metrics import CONTENT_TYPE, FrontDoorMetrics

RETRY_AFTER_S = 1  # what 429/503 answers suggest; the condition is usually brief
HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client that stalls its handshake gives up its thread after this
IO_TIMEOUT_S = 60.0  # one socket read or write; a client that stalls this long is gone (or slow-loris)
DRAIN_LIMIT_BYTES = 64 << 20  # an oversized body up to this is read and dropped, so the 413 reaches the client
DOOR = "http"
# A write or read that fails this way means the client is gone: the request is cancelled.
CLIENT_GONE = (ConnectionError, TimeoutError, ssl.SSLError)
ROUTES = {"/v1/completions": (parse_completion, CompletionShape),
          "/v1/chat/completions": (parse_chat, ChatShape)}


class TLSSetupError(ValueError):
    """The configured certificate or key cannot be loaded; the message names both files."""


HEALTH_CACHE_S = 0.5


class HealthCache:
    """The backend's last health answer, reused for `ttl_s`; one caller refreshes it at a time."""

    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._lock = threading.Lock()
        self._at = -float("inf")
        self._value: tuple[bool, dict] | None = None

    def get(self, fetch) -> tuple[bool, dict]:
        with self._lock:
            if self._value is None or time.monotonic() - self._at > self.ttl_s:
                self._value, self._at = fetch(), time.monotonic()
            return self._value


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, retry_after: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param = status, param
        self.outcome: str | None = None  # set from the error table; else by status
        self.headers = dict(headers or {})
        if retry_after is not None:
            self.headers["Retry-After"] = str(retry_after)


def api_error(exc: BaseException) -> ApiError:
    """The HTTP answer for an exception from the backend (router/errors.py's table)."""
    if isinstance(exc, ApiError):
        return exc
    row = errors.answer(exc)
    if row is errors.INTERNAL:
        return ApiError(500, errors.internal_message(exc))
    param = exc.field if isinstance(exc, InvalidRequest) else "model" if isinstance(exc, ModelNotFound) else None
    error = ApiError(row.http_status, errors.safe_text(exc), param, retry_after=RETRY_AFTER_S if row.retry else None)
    error.outcome = row.outcome
    return error


# The door's own answers (auth, routes, bodies); the rest come from router/errors.py's table.
OUTCOMES = {200: "ok", 401: "unauthenticated", 429: "overloaded", 503: "unavailable", 500: "error"}


def outcome(error: ApiError) -> str:
    """The metrics outcome for an answer (the same names the gRPC door uses)."""
    if error.outcome is not None:
        return error.outcome
    return OUTCOMES.get(error.status, "invalid" if 400 <= error.status < 500 else "error")


class ApiServer(ThreadingHTTPServer):
    """Binds at construction (so a taken port or an unreadable certificate fails before
    anything slow starts); serves once `backend` is set and serve_forever() runs. `metrics`
    and `auth` are the serve process's, shared with the gRPC door."""

    daemon_threads = True
    # socketserver's default listen backlog of 5 resets a burst's connections before any handler
    # sees them; with room to queue, each gets its answer (429 when the router is full).
    request_queue_size = 1024

    def __init__(self, host: str, port: int, frontdoor: FrontDoorConfig = FrontDoorConfig(),
                 metrics: FrontDoorMetrics | None = None, auth: Authenticator | None = None):
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._in_flight = 0
        self._idle = threading.Condition()
        self._closed = False
        self.bridge = LoopThread()  # where handler threads run the backend's coroutines
        self.cap, self.deadlines = ConnectionCap(frontdoor.max_connections), Deadlines()  # before a failed bind's close
        super().__init__((host, port), Handler)  # a failed bind closes the server, bridge included
        self.frontdoor = frontdoor
        self.metrics = metrics if metrics is not None else FrontDoorMetrics()
        self.auth = auth if auth is not None else Authenticator({})
        self.backend: Backend | None = None
        self.io_timeout_s = IO_TIMEOUT_S
        self.draining = threading.Event()
        self.health_cache = HealthCache(HEALTH_CACHE_S)
        if frontdoor.tls.enabled:
            try:
                context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                context.load_cert_chain(frontdoor.tls.cert_file, frontdoor.tls.key_file)
            except OSError as exc:  # ssl.SSLError included
                self.server_close()
                raise TLSSetupError(f"frontdoor.tls: cannot load cert_file {frontdoor.tls.cert_file} with key_file "
                                    f"{frontdoor.tls.key_file}: {exc.strerror or exc}") from None
            # The handshake runs in the request's own thread (finish_request), not in accept().
            self.socket = context.wrap_socket(self.socket, server_side=True, do_handshake_on_connect=False)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        scheme = "https" if self.frontdoor.tls.enabled else "http"
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"

    def finish_request(self, request, client_address) -> None:
        if isinstance(request, ssl.SSLSocket):
            try:
                request.settimeout(HANDSHAKE_TIMEOUT_S)
                request.do_handshake()
                request.settimeout(None)
            except (OSError, ssl.SSLError):
                return  # not TLS, a bad certificate on the other side, or gone: nothing to answer
        super().finish_request(request, client_address)

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self.deadlines.start()
        super().serve_forever(poll_interval)

    def process_request(self, request, client_address) -> None:
        if not self.cap.admit():  # over frontdoor.max_connections: 503 now, no thread for it
            refuse(request)
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.deadlines.disarm(request)
            self.cap.release()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def track(self, delta: int) -> None:
        with self._idle:
            self._in_flight += delta
            if not self._in_flight:
                self._idle.notify_all()
                if self._closed:
                    self.bridge.stop()

    def server_close(self) -> None:
        """Stop listening; the backend's loop stops once the requests in flight are answered."""
        super().server_close()
        self.deadlines.stop()
        with self._idle:
            self._closed = True
            if not self._in_flight:
                self.bridge.stop()

    def wait_idle(self, timeout_s: float) -> bool:
        """True once no request is in flight; False if `timeout_s` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: not self._in_flight, timeout_s)


class _Record:
    """What one generation request leaves in the metrics."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.outcome = "error"
        self.ttft_s: float | None = None
        self.usage = None


class Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def setup(self) -> None:
        self.timeout = self.server.io_timeout_s  # applied to the connection by super().setup()
        super().setup()

    def handle_one_request(self) -> None:
        # The request line and every header within header_timeout_s, however slowly they trickle.
        self.server.deadlines.arm(self.connection, self.server.frontdoor.header_timeout_s)
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()
        try:
            length = max(0, int(self.headers.get("Content-Length") or 0)) if ok else 0
        except ValueError:
            length = 0  # _body answers 400
        fd = self.server.frontdoor
        if length:  # then the body at min_body_bytes_per_s or faster
            self.server.deadlines.arm(self.connection, fd.header_timeout_s + length / fd.min_body_bytes_per_s)
        else:
            self.server.deadlines.disarm(self.connection)
        return ok

    # -- routes ---------------------------------------------------------------------
    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path == "/health":
                if not self.server.frontdoor.auth.public_health:
                    self._authorize()
                return self._health()
            if path == "/metrics":  # a scraper's metrics-only token is good here, and only here
                if not self.server.auth.may_scrape(self.headers.get("Authorization")):
                    self._authorize()  # the 401
                return self._metrics()
            self._authorize()
            if path == "/v1/models":
                self._send(200, {"object": "list", "data": [self._model()]})
            elif path.startswith("/v1/models/"):
                name = path.removeprefix("/v1/models/")
                if name != self._backend().model_name:
                    raise ModelNotFound(name, self._backend().model_name)
                self._send(200, self._model())
            else:
                raise ApiError(404, f"no route GET {path}; try /health, /metrics, /v1/models")
        except Exception as exc:
            self._error(api_error(exc))

    def do_POST(self) -> None:
        record, metrics = _Record(), self.server.metrics
        self.server.track(+1)
        metrics.in_flight.labels(DOOR).inc()
        try:
            tenant = self._authorize()
            body = self._body()
            path = urlsplit(self.path).path
            if path not in ROUTES:
                raise ApiError(404, f"no route POST {path}; try {' or '.join(ROUTES)}")
            self._generate(*ROUTES[path], body, tenant, record)
        except CLIENT_GONE:
            record.outcome = "cancelled"  # the client left before its answer
        except Exception as exc:
            error = api_error(exc)
            if error.status == 500:  # a bug: answer rather than drop the connection
                traceback.print_exc()
            record.outcome = outcome(error)
            self._error(error)
        finally:
            metrics.in_flight.labels(DOOR).dec()
            ok = record.outcome == "ok"
            metrics.finished(DOOR, record.outcome, record.ttft_s if ok else None,
                             time.monotonic() - record.start if ok else None, record.usage)
            self.server.track(-1)  # last: once idle, every answer is in the metrics

    # -- handlers -------------------------------------------------------------------
    def _authorize(self) -> str:
        """The caller's tenant; 401 unless auth is off or the bearer token is known."""
        auth = self.server.auth
        if not auth.enabled:
            return DEFAULT_TENANT
        tenant = auth.tenant(self.headers.get("Authorization"))
        if tenant is None:
            raise ApiError(401, "missing or unknown bearer token: send 'Authorization: Bearer TOKEN'",
                           headers={"WWW-Authenticate": 'Bearer realm="brigade"'})
        return tenant

    def _backend(self) -> Backend:
        if self.server.draining.is_set():
            raise ApiError(503, "server is shutting down; retry on another replica", retry_after=RETRY_AFTER_S)
        if self.server.backend is None:
            raise ApiError(503, "server is starting; retry shortly", retry_after=RETRY_AFTER_S)
        return self.server.backend

    def _model(self) -> dict:
        backend = self._backend()
        return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "brigade",
                "max_model_len": backend.max_model_len}

    def _health(self) -> None:
        """Cached for HEALTH_CACHE_S (a flood of probes asks the router once); with auth on, a
        caller without a token gets the status alone, not the workers, queue and index details."""
        if self.server.draining.is_set():
            return self._send(503, {"status": "draining"},
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        backend = self._backend()
        ok, details = self.server.health_cache.get(lambda: self.server.bridge.run(backend.health()))
        auth = self.server.auth
        if auth.enabled and auth.tenant(self.headers.get("Authorization")) is None:
            details = {}  # public: trimmed
        self._send(200 if ok else 503, {"status": "ok" if ok else "unavailable", **details},
                   headers=None if ok else {"Retry-After": str(RETRY_AFTER_S)})

    def _metrics(self) -> None:
        """Prometheus text; the router's queue gauges are read now, at scrape time."""
        metrics = self.server.metrics
        if self.server.backend is not None:
            _, details = self.server.bridge.run(self.server.backend.health())
            if "waiting" in details:
                metrics.set_router_queue(details["waiting"], details["running"])
        self._send_bytes(200, metrics.exposition(), CONTENT_TYPE)

    def _body(self) -> dict:
        limit = self.server.frontdoor.max_message_bytes
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError
        except ValueError:
            raise ApiError(400, f"bad Content-Length {self.headers.get('Content-Length')!r:.40}") from None
        if length > limit:
            if length <= DRAIN_LIMIT_BYTES:  # read it, so the client is not reset before it sees the 413
                with contextlib.suppress(TimeoutError):
                    while length > 0 and (got := self.rfile.read(min(length, 1 << 16))):
                        length -= len(got)
            raise ApiError(413, f"request body of {self.headers['Content-Length']} bytes is over the "
                                f"{limit}-byte limit (frontdoor.max_message_bytes)")
        try:
            data = self.rfile.read(length)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.server.io_timeout_s:g} s") from None
        finally:
            self.server.deadlines.disarm(self.connection)  # the answer's writes have their own timeout
        if len(data) < length:
            raise ApiError(400, f"request body ended after {len(data)} of {length} bytes (Content-Length)")
        try:
            body = json.loads(data or b"null")
        except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:  # too deep, too big
            raise ApiError(400, f"request body is not valid JSON: {type(exc).__name__}: {exc}"[:200]) from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        return body

    def _generate(self, parse, shape_cls, body: dict, tenant: str, record: _Record) -> None:
        backend = self._backend()
        parsed = parse(body, backend)
        shape = shape_cls(backend, parsed)
        req = GenerateRequest(shape.id, parsed.prompt_ids, parsed.params, cache_salt(tenant, parsed.cache_salt))
        with closing(self.server.bridge.iterate(backend.generate(req))) as chunks:
            first = next(chunks)  # admission errors surface here, before any header is sent
            record.ttft_s = time.monotonic() - record.start
            if parsed.stream:
                self._stream(shape, first, chunks, record)
            else:
                self._whole(shape, first, chunks, record)

    def _whole(self, shape: CompletionShape, first: Chunk, chunks: Iterator[Chunk], record: _Record) -> None:
        got, last = Collected(), first
        got.add(first)
        while not last.finished:
            if self._client_gone():
                raise ConnectionResetError("the client closed the connection")  # cancelled: abort the work
            last = next(chunks)
            got.add(last)
        record.usage = last.usage
        self._send(200, shape.whole(got, last.finish_reason, last.usage))
        record.outcome = "ok"

    def _stream(self, shape: CompletionShape, first: Chunk, chunks: Iterator[Chunk], record: _Record) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        chunk = first
        try:
            for event in shape.opening():
                self._event(event)
            while True:
                self._event(shape.delta(chunk))
                if chunk.finished:
                    break
                chunk = next(chunks)
            if shape.parsed.include_usage:
                self._event(shape.usage_event(chunk.usage))
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
            record.usage, record.outcome = chunk.usage, "ok"
        except CLIENT_GONE:
            raise  # do_POST records it; closing `chunks` aborts the request
        except Exception as exc:  # headers are out: report the failure in the stream
            error = api_error(exc)
            record.outcome = outcome(error)
            self._event({"error": _error_body(error)})

    def _client_gone(self) -> bool:
        """Whether a plain-TCP client has closed its end (it sends nothing more after its
        request, so a readable socket with nothing to read means EOF). Not checked under TLS,
        where peeking is not possible; there a whole answer finishes before the loss shows."""
        conn = self.connection
        if isinstance(conn, ssl.SSLSocket) or not readable(conn):
            return False
        try:
            return conn.recv(1, socket.MSG_PEEK) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True

    # -- output ---------------------------------------------------------------------
    def _event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def _send(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
        self._send_bytes(status, json.dumps(payload).encode(), "application/json", headers)

    def _send_bytes(self, status: int, data: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def _error(self, exc: ApiError) -> None:
        try:
            self._send(exc.status, {"error": _error_body(exc)}, headers=exc.headers)
        except CLIENT_GONE:
            pass


def _error_body(error: ApiError) -> dict:
    kind = {401: "authentication_error", 429: "rate_limit_error"}.get(
        error.status, "invalid_request_error" if error.status < 500 else "server_error")
    code = {401: "invalid_api_key", 404: "model_not_found" if error.param == "model" else None,
            413: "request_too_large"}.get(error.status)
    return {"message": str(error), "type": kind, "param": error.param, "code": code}
