"""One connection at the OpenAI-compatible HTTP front door: the stdlib handler for its requests.

Per request: its header and body deadlines (router/http/guards.py), auth, then the route:
GET /health (cached for HEALTH_CACHE_S), /metrics, /v1/models[/{id}], /openapi.json (the API's
OpenAPI 3.1 document, router/http/api_schema.py); POST /v1/completions and
/v1/chat/completions go to router/http/generation.py once the body is read and is a JSON object.

Errors are OpenAI-shaped, `{"error": {"message", "type", "param", "code"}}` (router/http/answers.py),
with the status of router/errors.py's table: 400 for a bad request (naming `param`), 404 for
another model, 429 with Retry-After when the router's queue is full, 503 with Retry-After when
no worker of a needed role is alive; and the door's own: 401 with `WWW-Authenticate: Bearer`
without a known token, 404 for an unknown route, 413 for a body declared over
`frontdoor.max_message_bytes` (at once, before any of it is read), 400 for a body nested deeper
than engine.json_nesting.MAX_DEPTH (naming the top-level field), 503 while starting or draining.

Auth (when tokens are configured) covers every route, /metrics included (Prometheus sends
the token with `authorization: {credentials_file: ...}`), except /health while
`auth.public_health` (probes carry no secrets). The token's tenant is the request's cache
salt (router.auth.cache_salt). Each generation request (POST) is recorded in the shared
FrontDoorMetrics under door="http"; a client that leaves mid-stream is "cancelled".
"""
from __future__ import annotations

import contextlib
import json
import logging
import socket
import ssl
import time
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from engine.json_nesting import MAX_DEPTH, nests_deeper_than
from router.auth import DEFAULT_TENANT
from router.backend import Backend
from router.errors import ModelNotFound
from router.http.answers import RETRY_AFTER_S, ApiError, api_error, error_body, outcome
from router.http.api_schema import openapi_document
from router.http.generation import CLIENT_GONE, ROUTES, Record, generate
from router.metrics import CONTENT_TYPE

if TYPE_CHECKING:
    from router.http.server import ApiServer

log = logging.getLogger(__name__)
IO_TIMEOUT_S = 60.0  # one socket read or write; a client that stalls this long is gone (or slow-loris)
# The kernel's send buffer for one connection, fixed (Linux would grow it to megabytes for a
# client that reads slowly): past it the handler's write waits, so a slow reader's stream waits
# at the door, and the window behind it (engine.messages.STREAM_WINDOW_CHUNKS) up to the worker.
SEND_BUFFER_BYTES = 128 << 10
# After a 413 (sent at once, before its body), what the client is still sending is read and
# dropped for this long, so that closing does not reset the connection before it reads the
# answer; then the connection closes, however much more it declared.
DRAIN_GRACE_S = 1.0
DRAIN_LIMIT_BYTES = 64 << 20
BODY_READ_BYTES = 1 << 16
DOOR = "http"


class Handler(BaseHTTPRequestHandler):
    server: ApiServer

    def setup(self) -> None:
        self.timeout = self.server.io_timeout_s  # applied to the connection by super().setup()
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
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
        self.body_started = time.monotonic()
        if length > fd.max_message_bytes:  # answered 413 at once (_body), then drained for DRAIN_GRACE_S
            self.server.deadlines.arm(self.connection, fd.header_timeout_s + DRAIN_GRACE_S)
        elif length:  # a grace of header_timeout_s, extended as the body arrives (_read_body)
            self.server.deadlines.arm(self.connection, fd.header_timeout_s)
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
                self.send_json(200, {"object": "list", "data": [self._model()]})
            elif path == "/openapi.json":
                self.send_json(200, self._openapi())
            elif path.startswith("/v1/models/"):
                name = path.removeprefix("/v1/models/")
                if name != self.live_backend().model_name:
                    raise ModelNotFound(name, self.live_backend().model_name)
                self.send_json(200, self._model())
            else:
                raise ApiError(404, f"no route GET {path}; try /health, /metrics, /v1/models, /openapi.json")
        except Exception as exc:
            self._error(api_error(exc))

    def do_POST(self) -> None:
        record, metrics = Record(), self.server.metrics
        self.over_limit = False
        self.server.track(+1)
        metrics.in_flight.labels(DOOR).inc()
        try:
            tenant = self._authorize()
            body = self._body()
            path = urlsplit(self.path).path
            if path not in ROUTES:
                raise ApiError(404, f"no route POST {path}; try {' or '.join(ROUTES)}")
            generate(self, *ROUTES[path], body, tenant, record)
        except CLIENT_GONE:
            record.outcome = "cancelled"  # the client left before its answer
        except Exception as exc:
            error = api_error(exc)  # a bug (500) is logged there, once, under the log id the client reads
            record.outcome = outcome(error)
            self._error(error)
            if self.over_limit:
                self._drain()
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

    def live_backend(self) -> Backend:
        if self.server.draining.is_set():
            raise ApiError(503, "server is shutting down; retry on another replica", retry_after=RETRY_AFTER_S)
        if self.server.backend is None:
            raise ApiError(503, "server is starting; retry shortly", retry_after=RETRY_AFTER_S)
        return self.server.backend

    def _model(self) -> dict:
        backend = self.live_backend()
        return {"id": backend.model_name, "object": "model", "created": 0, "owned_by": "brigade",
                "max_model_len": backend.max_model_len}

    def _openapi(self) -> dict:
        """Built once per server: it depends only on the served model and the auth settings."""
        server = self.server
        if server.openapi is None:
            backend, auth = self.live_backend(), server.frontdoor.auth
            server.openapi = openapi_document(backend.model_name, backend.vocab_size, backend.max_model_len,
                                              server.auth.enabled, auth.public_health)
        return server.openapi

    def _health(self) -> None:
        """Cached for HEALTH_CACHE_S (a flood of probes asks the router once); with auth on, a
        caller without a token gets the status alone, not the workers, queue and index details."""
        if self.server.draining.is_set():
            return self.send_json(503, {"status": "draining"},
                              headers={"Retry-After": str(RETRY_AFTER_S)})
        backend = self.live_backend()
        ok, details = self.server.health_cache.get(lambda: self.server.bridge.run(backend.health()))
        auth = self.server.auth
        if auth.enabled and auth.tenant(self.headers.get("Authorization")) is None:
            details = {}  # public: trimmed
        self.send_json(200 if ok else 503, {"status": "ok" if ok else "unavailable", **details},
                   headers=None if ok else {"Retry-After": str(RETRY_AFTER_S)})

    def _metrics(self) -> None:
        """Prometheus text; the router's queue gauges and the workers' step counters are read
        now, at scrape time."""
        metrics = self.server.metrics
        if self.server.backend is not None:
            _, details = self.server.bridge.run(self.server.backend.health())
            if "waiting" in details:
                metrics.set_router_queue(details["waiting"], details["running"])
            try:
                metrics.set_worker_stats(self.server.bridge.run(self.server.backend.worker_stats()))
            except Exception as exc:  # noqa: BLE001 - the door's own series still answer; the workers' keep their last
                log.warning("/metrics: the workers' counters could not be read: %r", exc)
        self._send_bytes(200, metrics.exposition(), CONTENT_TYPE)

    def _body(self) -> dict:
        limit = self.server.frontdoor.max_message_bytes
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length < 0:
                raise ValueError
        except ValueError:
            raise ApiError(400, f"bad Content-Length {self.headers.get('Content-Length')!r:.40}") from None
        if length > limit:  # answered before any of it is read (do_POST then drains for DRAIN_GRACE_S)
            self.over_limit = True
            raise ApiError(413, f"request body of {self.headers['Content-Length']} bytes is over the "
                                f"{limit}-byte limit (frontdoor.max_message_bytes)")
        data = self._read_body(length)
        if len(data) < length:
            raise ApiError(400, f"request body ended after {len(data)} of {length} bytes (Content-Length)")
        try:
            body = json.loads(data or b"null")
        except (ValueError, UnicodeDecodeError, RecursionError, OverflowError) as exc:  # too deep, too big
            raise ApiError(400, f"request body is not valid JSON: {type(exc).__name__}: {exc}"[:200]) from None
        if not isinstance(body, dict):
            raise ApiError(400, "request body must be a JSON object")
        for key, value in body.items():  # before anything recurses over it (the chat template's walk)
            if nests_deeper_than(value, MAX_DEPTH - 1):
                raise ApiError(400, f"{key!r:.60} is nested deeper than {MAX_DEPTH} levels of objects and arrays "
                                    f"(the body counted as one); flatten it", param=key)
        return body

    def _read_body(self, length: int) -> bytes:
        """`length` bytes (at most max_message_bytes), or fewer if the client ends or stalls. The
        deadline follows what has arrived: header_timeout_s of grace from the headers' end, plus
        1 / min_body_bytes_per_s for each byte received, so a client that declares a large body
        and trickles it is cut off for its trickle, not given time for what it only promised."""
        fd, deadlines = self.server.frontdoor, self.server.deadlines
        chunks, got = [], 0
        try:
            while got < length:
                chunk = self.rfile.read1(min(length - got, BODY_READ_BYTES))
                if not chunk:
                    break  # the client ended, or the deadline shut its socket
                chunks.append(chunk)
                got += len(chunk)
                deadlines.arm_until(self.connection, self.body_started + fd.header_timeout_s
                                    + got / fd.min_body_bytes_per_s)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.server.io_timeout_s:g} s") from None
        finally:
            deadlines.disarm(self.connection)  # the answer's writes have their own timeout
        return b"".join(chunks)

    def _drain(self) -> None:
        """After a 413 sent before its body: the answer is complete (FIN), then what the client
        is still sending is read and dropped for DRAIN_GRACE_S at most, so that closing does not
        reset the connection before the client reads the 413; then the connection closes."""
        self.close_connection = True
        conn, end, left = self.connection, time.monotonic() + DRAIN_GRACE_S, DRAIN_LIMIT_BYTES
        with contextlib.suppress(OSError, ValueError):
            if not isinstance(conn, ssl.SSLSocket):  # a TLS socket's shutdown would end its session
                conn.shutdown(socket.SHUT_WR)
            while left > 0 and (remaining := end - time.monotonic()) > 0:
                conn.settimeout(remaining)
                got = self.rfile.read1(min(left, BODY_READ_BYTES))
                if not got:
                    break
                left -= len(got)

    # -- output ---------------------------------------------------------------------
    def send_event(self, payload: dict) -> None:
        self.wfile.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        self.wfile.flush()

    def send_json(self, status: int, payload: dict, headers: dict[str, str] | None = None) -> None:
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
            self.send_json(exc.status, {"error": error_body(exc)}, headers=exc.headers)
        except CLIENT_GONE:
            pass
