"""The gRPC front door's lifetime: a grpc.aio server on its own event-loop thread.

It binds at construction (a taken port fails before anything slow starts; SO_REUSEPORT is
off so a second server cannot silently share the port), answers UNAVAILABLE "starting" and
health NOT_SERVING until attach() hands it a backend, and drains on request: health
NOT_SERVING and new requests UNAVAILABLE at once, streams in flight finish (up to the drain
window), then the listener closes. Besides brigade.v1.Brigade it serves grpc.health.v1
(kept up to date from the backend's health: NOT_SERVING with no live worker of a needed role)
and server reflection. Handlers run on this loop; each stream's chunks are read from the
router by a thread of their own (ClusterBackend.generate) and handed to the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import logging
import threading
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from router.auth import Authenticator
from router.backend import Backend
from router.config import FrontDoorConfig
from router.grpc.service import SERVICE, BrigadeService, DoorState
from router.metrics import FrontDoorMetrics

log = logging.getLogger(__name__)
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class GrpcServer:
    def __init__(self, host: str, port: int, frontdoor: FrontDoorConfig, metrics: FrontDoorMetrics,
                 auth: Authenticator | None = None, health_interval_s: float = 1.0):
        """Raises OSError if it cannot listen on host:port, AuthSetupError for unreadable tokens
        (when no ready `auth` is given: the serve process shares one with the HTTP door)."""
        self.state = DoorState(auth or Authenticator.from_config(frontdoor.auth), metrics)
        self.health_interval_s = health_interval_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="grpc", daemon=True)
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._health = HealthServicer()
        self._refresher: asyncio.Task | None = None
        try:
            bound = self._call(self._start(host, port, frontdoor))
        except BaseException:
            self.close()
            raise
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"
        self.tls = frontdoor.tls.enabled

    # -- lifetime (called from the serving thread) ---------------------------------------
    def attach(self, backend: Backend) -> None:
        """Serve through `backend` from now on."""
        self.state.backend = backend
        self._call(self._refresh())

    def begin_drain(self, timeout_s: float) -> concurrent.futures.Future:
        """Start draining; the future's result is True if every request in flight finished in time."""
        return asyncio.run_coroutine_threadsafe(self._drain(timeout_s), self._loop)

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    def close(self) -> None:
        """Stop at once (cancelling what still runs) and end the loop thread. Idempotent."""
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._call(self._stop(), timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        if not self._loop.is_running() and not self._loop.is_closed():
            self._loop.close()

    def _call(self, coro, timeout: float | None = 30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # -- on the loop ----------------------------------------------------------------------
    async def _start(self, host: str, port: int, frontdoor: FrontDoorConfig) -> int:
        # BDP probing would grow each stream's receive window to megabytes, so an unauthenticated
        # caller's unsent bytes would land in our buffers before the refusal (measured: 20 refused
        # 4 MiB calls grew RSS by 98 MB with it, 0.5 MB without; an accepted 4 MiB call on
        # loopback takes 13 ms instead of 11).
        options = [("grpc.max_receive_message_length", frontdoor.max_message_bytes), ("grpc.so_reuseport", 0),
                   ("grpc.http2.bdp_probe", 0)]
        public = (HEALTH_SERVICE,) if frontdoor.auth.public_health else ()
        interceptors = [_AuthInterceptor(self.state.auth, public, self.state.metrics)]
        self._server = grpc.aio.server(interceptors=interceptors, options=options,
                                       maximum_concurrent_rpcs=frontdoor.max_concurrent_rpcs)
        self._server.add_generic_rpc_handlers((BrigadeService(self.state).handlers(),))
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        reflection.enable_server_reflection((SERVICE, HEALTH_SERVICE, reflection.SERVICE_NAME), self._server)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            if frontdoor.tls.enabled:
                key, cert = Path(frontdoor.tls.key_file).read_bytes(), Path(frontdoor.tls.cert_file).read_bytes()
                creds = grpc.ssl_server_credentials([(key, cert)])
                bound = self._server.add_secure_port(address, creds)
            else:
                bound = self._server.add_insecure_port(address)
        except RuntimeError:  # gRPC's own message says only "Failed to bind"
            raise OSError(errno.EADDRINUSE, "the port is in use, or the host is not an address of this machine",
                          address) from None
        await self._server.start()
        for name in ("", SERVICE):
            await self._health.set(name, NOT_SERVING)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())
        return bound

    async def _refresh(self) -> None:
        if self.state.draining:
            return
        ok = False
        if self.state.backend is not None:
            try:
                ok, details = await self.state.backend.health()
                if "running" in details:  # the queue gauges an autoscaler reads from /metrics
                    self.state.metrics.set_router_queue(details["waiting"], details["running"])
            except Exception as exc:
                log.warning("health check failed: %r", exc)
        for name in ("", SERVICE):
            await self._health.set(name, SERVING if ok else NOT_SERVING)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            await self._refresh()

    async def _drain(self, timeout_s: float) -> bool:
        self.state.draining = True
        await self._health.enter_graceful_shutdown()  # NOT_SERVING from now on, whatever _refresh finds
        deadline = time.monotonic() + timeout_s
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        idle = not self.state.in_flight
        await self._stop()
        return idle

    async def _stop(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        if self._server is not None:
            await self._server.stop(grace=None)


class _AuthInterceptor(grpc.aio.ServerInterceptor):
    """Bearer-token check before any handler runs or any request is parsed: brigade.v1.Brigade
    (which reads the caller's tenant again itself) and reflection always, health unless it is
    public. A refused call's bytes are never deserialized (an unauthenticated 4 MiB request
    costs its receive buffer and nothing else)."""

    GENERATIONS = (f"/{SERVICE}/Generate", f"/{SERVICE}/GenerateUnary")  # counted in the request metrics

    def __init__(self, auth: Authenticator, public: tuple[str, ...], metrics: FrontDoorMetrics):
        self.auth, self.public, self.metrics = auth, public, metrics

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        service = details.method.split("/")[1] if details.method.count("/") >= 2 else ""
        if handler is None or not self.auth.enabled or service in self.public:
            return handler
        token = dict((k, v) for k, v in details.invocation_metadata or () if isinstance(v, str)).get("authorization")
        if self.auth.tenant(token) is not None:
            return handler
        if details.method in self.GENERATIONS:
            self.metrics.finished("grpc", "unauthenticated", None, None, None)
        return _denied(handler)


def _denied(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler that refuses before reading the request: served as request-streaming whatever
    the method's kind (the wire format is the same), so gRPC never collects the message; the
    abort resets the stream and the client's unsent bytes are never received."""
    async def deny(_requests, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or unknown bearer token "
                            "(send metadata 'authorization: Bearer TOKEN')")

    kind = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return kind(deny, request_deserializer=None, response_serializer=handler.response_serializer)
