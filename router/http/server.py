"""The OpenAI-compatible HTTP front door's server: stdlib HTTP over the doors' `Backend`
(router/backend.py), its listening socket (TLS optional), connection cap and deadlines, the
requests in flight (for draining) and the loop thread its handlers run the backend on.

One connection is served by router/http/handler.py's Handler: auth, the GET routes and the
bodies; a completion or chat request by router/http/generation.py; errors are answered by
router/http/answers.py. The handlers never hold an engine: the backend reaches the workers
(Ray actors behind the router, in `cluster/backend.py`).
"""
from __future__ import annotations

import socket
import ssl
import sys
import threading
import time
from http.server import ThreadingHTTPServer

from router.auth import Authenticator
from router.backend import Backend
from router.config import FrontDoorConfig
from router.http.bridge import LoopThread
from router.http.guards import ConnectionCap, Deadlines, refuse
from router.http.handler import IO_TIMEOUT_S, Handler
from router.metrics import FrontDoorMetrics

HANDSHAKE_TIMEOUT_S = 10.0  # a TLS client that stalls its handshake gives up its thread after this
HEALTH_CACHE_S = 0.5


class TLSSetupError(ValueError):
    """The configured certificate or key cannot be loaded; the message names both files."""


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
        self.openapi: dict | None = None  # GET /openapi.json, built on first use
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

    def handle_error(self, request, client_address) -> None:
        """A client that left (or one the deadlines cut off) while its answer was written is
        routine, not a traceback in the log: hostile clients could flood it with those."""
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError, ssl.SSLError)):
            return
        super().handle_error(request, client_address)

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
