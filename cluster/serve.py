"""`brigade serve`: the cluster (router + prefill/decode Ray actors) behind the HTTP and gRPC APIs.

Start-up runs in the order that makes the cheap failures come first: the config (checked by
the CLI before this runs), the HTTP and gRPC ports (and the auth tokens), the model's
config.json and tokenizer, Redis (an embedded redis-server on 127.0.0.1 unless --redis-url),
Ray and the actors (each worker registers its own lease in Redis and publishes its cache
events there). Then it serves until SIGINT or SIGTERM, and drains: /health answers 503 and
gRPC health NOT_SERVING, new requests are refused, requests in flight (on both doors at once)
get `drain_s` (--drain-s, 30 s) to finish, and everything started here stops in reverse
order. Exit code 0.
While serving it watches what it started (cluster/watchdog.py): when the router actor or a
local Ray's GCS or raylet dies it says so, stops everything and exits EXIT_FAILED (3).
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import socket
import sys
import threading
import time

import yaml

from cluster.cli import UsageError
from cluster.config import PER_WORKER, ClusterConfig, redis_url_with_password
from cluster.ray_auth import check_ray_exposure
from router.auth import Authenticator, AuthSetupError
from router.grpc.server import GrpcServer
from router.http.server import ApiServer, TLSSetupError
from router.metrics import FrontDoorMetrics

WATCH_INTERVAL_S = 1.0  # how often the parts serve started are checked (cluster/watchdog.py)


class _Stop(BaseException):
    """A stop signal during start-up: unwinds through the cleanup below."""


def config_yaml(cfg: ClusterConfig) -> str:
    data = cfg.model_dump(mode="json")
    for name in PER_WORKER:  # filled in per worker (cluster.config.worker_config)
        data["engine"].pop(name, None)
    if data.get("redis_url"):
        data["redis_url"] = re.sub(r"//[^@/]*@", "//***@", data["redis_url"])
    return yaml.safe_dump(data, sort_keys=False)


def run(args, cfg: ClusterConfig) -> int:
    print("# brigade serve: resolved config (file, then flags)", flush=True)
    print(config_yaml(cfg), end="", flush=True)
    try:  # one of each per process, shared by both front doors
        auth = Authenticator.from_config(cfg.frontdoor.auth)
        redis_url = redis_url_with_password(cfg.redis_url, cfg.redis_password_env) if cfg.redis_url else None
        check_ray_exposure(cfg.host, cfg.ray_address)  # RayAuthOff is a ValueError
    except (AuthSetupError, ValueError) as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "check", False):
        check_files(cfg)
        print("# config OK", flush=True)
        return 0
    metrics = FrontDoorMetrics()
    try:  # before anything slow, so a taken port or a bad certificate fails at once
        server = ApiServer(cfg.host, cfg.http_port, cfg.frontdoor, metrics=metrics, auth=auth)
    except TLSSetupError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"cannot listen on {cfg.host}:{cfg.http_port}: {exc.strerror or exc}; "
                         "pick another --http-port or --host") from None
    try:  # the gRPC door's threads start only once Ray is up (forking Ray's daemons with gRPC
        _grpc_port_free(cfg)  # threads alive is what made a local Ray start time out); its port is checked now
    except BaseException:
        server.server_close()
        raise

    signals = _Signals().install()
    services = _Services()
    stopping = False  # a stop was asked for (rather than an error): say when it is done
    leftovers = None  # after a fatal failure: the processes to be sure are gone at the end
    try:
        try:
            services.start(cfg, signals, redis_url, after_ray=lambda: _grpc_server(cfg, metrics, auth))
        except _Stop as why:
            print(f"{why} during start-up: stopping", file=sys.stderr, flush=True)
            stopping = True
            return 0
        grpc_server = services.grpc_server
        server.backend = services.backend
        if grpc_server is not None:
            grpc_server.attach(services.backend)
        signals.starting = False
        threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
        print(_serving_line(cfg, services, server.url), flush=True)
        from cluster.watchdog import EXIT_FAILED, Watchdog, descendants  # imports ray, as the services did

        watchdog = Watchdog(services, local_ray=not cfg.ray_address)
        while not signals.stop.wait(WATCH_INTERVAL_S):
            failure = watchdog.check()
            if failure is not None:  # nothing to drain: requests cannot finish without what died
                print(f"error: {failure}; stopping (exit code {EXIT_FAILED})", file=sys.stderr, flush=True)
                leftovers = descendants()
                return EXIT_FAILED
        stopping = True
        grpc_drained = grpc_server.begin_drain(cfg.drain_s) if grpc_server is not None else None
        _drain(server, cfg.drain_s)
        if grpc_drained is not None and not _finished(grpc_drained, cfg.drain_s + 10):
            print(f"{grpc_server.in_flight} gRPC request(s) still running after {cfg.drain_s:g} s: stopping anyway",
                  file=sys.stderr, flush=True)
        return 0
    finally:
        signals.starting = False  # a signal from here on only sets `stop`
        if services.grpc_server is not None:
            services.grpc_server.close()
        server.server_close()
        services.stop()
        if leftovers is not None:
            from cluster.watchdog import stop_leftovers

            stop_leftovers(leftovers)
        if stopping:
            print("stopped", file=sys.stderr, flush=True)


def _serving_line(cfg: ClusterConfig, services: _Services, url: str) -> str:
    """The line that says the serve is up (what scripts wait for: `Brigade serving ... at URL/v1 `)."""
    workers = (f"{cfg.decode} mixed" if cfg.mode == "colocated"
               else f"{cfg.num_prefill} prefill, {cfg.decode} decode")
    if cfg.role == "front":
        workers = f"front over {len(services.cluster.workers)} workers of {cfg.ray_address}"
    grpc = services.grpc_server
    grpc_at = f" and grpc://{grpc.address}" if grpc is not None else ""
    return f"Brigade serving {cfg.model} at {url}/v1{grpc_at} ({workers}, {cfg.mode})"


def check_files(cfg: ClusterConfig) -> None:
    """--check: the TLS files exist and are readable (serving loads them; this only looks)."""
    for name in ("cert_file", "key_file"):
        path = getattr(cfg.frontdoor.tls, name)
        if path is not None and not os.access(path, os.R_OK):
            raise UsageError(f"frontdoor.tls.{name} {path}: not a readable file; check the path or the mount")


def _finished(drained, timeout_s: float) -> bool:
    """The gRPC drain's result: True if every request in flight finished in time."""
    try:
        return bool(drained.result(timeout_s))
    except Exception as exc:  # a drain that failed or hung: stopping goes on regardless
        print(f"gRPC drain: {exc!r}", file=sys.stderr, flush=True)
        return False


def _grpc_port_free(cfg: ClusterConfig) -> None:
    """UsageError now if the gRPC port is taken (or the host is not ours), as the server would
    say later; binds and lets go at once."""
    if not cfg.grpc_port:  # none, or 0: any free port
        return
    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's own listener does
        try:
            probe.bind((cfg.host, cfg.grpc_port))
        except OSError as exc:
            why = "the port is in use" if exc.errno == errno.EADDRINUSE else exc.strerror or str(exc)
            raise UsageError(f"cannot listen for gRPC on {cfg.host}:{cfg.grpc_port}: {why}; "
                             "pick another --grpc-port or --host") from None


def _grpc_server(cfg: ClusterConfig, metrics: FrontDoorMetrics, auth: Authenticator) -> GrpcServer | None:
    """Listening (answering "starting" until the backend is attached), or None with grpc_port null."""
    if cfg.grpc_port is None:
        return None
    try:
        return GrpcServer(cfg.host, cfg.grpc_port, cfg.frontdoor, metrics, auth)
    except OSError as exc:
        raise UsageError(f"cannot listen for gRPC on {cfg.host}:{cfg.grpc_port}: {exc.strerror or exc}; "
                         "pick another --grpc-port or --host") from None


class _Signals:
    """SIGINT/SIGTERM set `stop`. During start-up, start() checks it between steps (raising
    _Stop, which unwinds through the cleanup): an exception raised from a signal handler
    inside Ray's C++ calls leaves Ray in a broken state. A second signal during start-up
    raises at once, for a start that hangs."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.starting = True
        self._count = 0

    def install(self) -> _Signals:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.stop.set()
        self._count += 1
        if self.starting and self._count > 1:
            raise _Stop(f"a second {signal.Signals(signum).name}")

    def check(self) -> None:
        if self.stop.is_set() and self.starting:
            raise _Stop("a stop signal")

    @contextlib.contextmanager
    def kept_through_ray_init(self):
        """ray.init installs SIGTERM handlers that exit from wherever it is (leaking the agents
        a half-started raylet was spawning): keep ours instead, and stop once Ray is whole."""
        from ray._private import utils as ray_utils

        install_ray_handler, ray_utils.set_sigterm_handler = ray_utils.set_sigterm_handler, lambda _handler: None
        try:
            yield
        finally:
            ray_utils.set_sigterm_handler = install_ray_handler
            self.install()


def _drain(server: ApiServer, drain_s: float) -> None:
    print(f"stopping: draining {server.in_flight} request(s) in flight (up to {drain_s:g} s) ...",
          file=sys.stderr, flush=True)
    server.draining.set()  # /health and new requests answer 503 from here on
    server.shutdown()
    server.server_close()  # new connections are refused; handler threads carry on
    if not server.wait_idle(drain_s):
        print(f"{server.in_flight} request(s) still running after {drain_s:g} s: stopping anyway",
              file=sys.stderr, flush=True)


class _Services:
    """What `serve` starts besides the HTTP server, stopped in reverse order (each part
    only if it started)."""

    def __init__(self) -> None:
        self.redis = None
        self.cluster = None
        self.supervisor = None
        self.ray_started = False
        self.backend = None
        self.grpc_server: GrpcServer | None = None

    def start(self, cfg: ClusterConfig, signals: _Signals, redis_url: str | None,
              after_ray=lambda: None) -> None:
        """`after_ray()`: the gRPC door, made once Ray is up (its threads must not exist at
        Ray's forks); it answers "starting" while the workers launch."""
        from cluster.redis_server import EmbeddedRedis, RedisServerError
        from router.index.registry import RegistryError, connect

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from cluster.backend import ClusterBackend  # imports ray
        from cluster.launch import launch, start_ray

        backend = ClusterBackend(cfg)  # reads config.json + tokenizer: a bad --model fails before Ray
        signals.check()
        try:
            if redis_url is None:
                self.redis = EmbeddedRedis().start()
                print(f"redis: embedded redis-server at {self.redis.shown_url}", file=sys.stderr, flush=True)
                redis_url = self.redis.url
            # A wrong password or unreachable Redis fails here, saying which; a front serves by load
            # while the shared Redis is down (it holds hints only) and picks the index up later.
            connect(redis_url, must_answer=cfg.role == "owner").close()
        except (RedisServerError, RegistryError) as exc:
            raise UsageError(str(exc)) from None

        print(f"starting Ray {'(joining ' + cfg.ray_address + ')' if cfg.ray_address else 'locally'} "
              "and the workers ...", file=sys.stderr, flush=True)
        signals.check()
        self.ray_started = True
        with signals.kept_through_ray_init():
            start_ray(cfg)
        signals.check()
        self.grpc_server = after_ray()
        if cfg.role == "front":  # the owner's workers, found by name: nothing is started (cluster/front.py)
            from cluster.front import Front

            self.cluster = Front(cfg, redis_url).start()
        else:
            self.cluster = launch(cfg, redis_url)  # the longest step: a stop signal takes effect after it
        signals.check()
        backend.attach(self.cluster)
        self.backend = backend
        if cfg.supervisor.enabled and cfg.role == "owner":
            from cluster.supervisor import Supervisor

            self.supervisor = Supervisor(self.cluster, cfg.supervisor).start()

    def stop(self) -> None:
        if self.supervisor is not None:  # first: nothing may be restarted while stopping
            _quietly(self.supervisor.stop)
            self.supervisor = None
        if self.cluster is not None:
            _quietly(self.cluster.shutdown)
            self.cluster = None
        if self.ray_started:
            import ray

            _quietly(ray.shutdown)
            self.ray_started = False
        if self.redis is not None:
            self.redis.stop()
            self.redis = None


def _quietly(fn, *args) -> None:
    start = time.monotonic()
    try:
        fn(*args)
    except Exception as exc:  # stopping goes on: what could not stop is reported, not fatal
        print(f"while stopping ({getattr(fn, '__qualname__', fn)}): {exc!r}", file=sys.stderr, flush=True)
    if time.monotonic() - start > 10:
        print(f"{getattr(fn, '__qualname__', fn)} took {time.monotonic() - start:.0f} s", file=sys.stderr)
