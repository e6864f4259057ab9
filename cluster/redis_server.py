"""A private, throwaway `redis-server` for `brigade` runs without `--redis-url`, and for tests.

Redis only holds soft state here (worker leases, the prefix index: hints that rebuild
themselves), so the embedded server keeps nothing on disk and listens on loopback only,
with a random password made at each start unless one is given (any local user could
otherwise connect to 127.0.0.1 and rewrite the leases and the index). A deployment that spans
machines passes `--redis-url` to a Redis it runs itself.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time
import weakref
from pathlib import Path
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

# Where Debian/Ubuntu put the binary; sbin and /usr/bin are often missing from a non-root PATH.
FALLBACK_PATHS = ("/usr/bin/redis-server", "/usr/sbin/redis-server")
START_TIMEOUT_S = 10.0
_PLAIN = frozenset(string.ascii_letters + string.digits + "/._-")


class RedisServerError(RuntimeError):
    """redis-server is missing or did not come up."""


def find_redis_server() -> str:
    """The redis-server binary, or a RedisServerError that says how to get one."""
    found = shutil.which("redis-server") or next((p for p in FALLBACK_PATHS if os.access(p, os.X_OK)), None)
    if found is None:
        raise RedisServerError("redis-server not found (looked in PATH and " + ", ".join(FALLBACK_PATHS) + "): "
                               "install it (`apt-get install redis-server`) or pass --redis-url to use a running Redis")
    return found


def _free_port() -> int:
    # Racy by nature (another process may take it before redis binds); start() retries.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _conf_string(value: str) -> str:
    # redis.conf's quoted strings understand \xHH, so any path or password survives unmangled.
    return '"' + "".join(chr(b) if chr(b) in _PLAIN else f"\\x{b:02x}" for b in value.encode()) + '"'


def _terminate(proc: subprocess.Popen, workdir: str, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL; always reap, so no zombie or orphan outlives us. Idempotent."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    shutil.rmtree(workdir, ignore_errors=True)


class EmbeddedRedis:
    """A redis-server child on 127.0.0.1:<free port>; no persistence; stopped by stop() or `with`.
    `password`: None makes a random one (in `url`, for this process's clients); "" none at all.

    Settings go in a config file in a private (0700) temp dir rather than on the command
    line, so a password never shows in `ps`. A finalizer stops the server even if the
    owner forgets to (or the interpreter exits), so tests cannot leak servers.
    """

    def __init__(self, password: str | None = None, binary: str | None = None, stop_timeout_s: float = 5.0,
                 port: int = 0):
        self.password = secrets.token_urlsafe(24) if password is None else password
        self.binary = binary or find_redis_server()
        self.stop_timeout_s = stop_timeout_s
        self.port = port  # 0: a free one at each start; else this one (a restart keeps its address)
        self._fixed_port = port
        self.proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def shown_url(self) -> str:
        """`url` with the password masked, for logs."""
        return f"redis://{':***@' if self.password else ''}127.0.0.1:{self.port}/0"

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, attempts: int = 3) -> EmbeddedRedis:
        """Starts the server (no-op if running); retries on a fresh port if another process took ours."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        for attempt in range(attempts):
            try:
                return self._start_once()
            except RedisServerError as e:
                if "Address already in use" not in str(e) or attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self) -> EmbeddedRedis:
        workdir = tempfile.mkdtemp(prefix="brigade-redis-")
        self.port = self._fixed_port or _free_port()
        conf = [f"port {self.port}", "bind 127.0.0.1", "protected-mode yes", 'save ""', "appendonly no",
                "daemonize no", f"dir {_conf_string(workdir)}"]
        if self.password:
            conf.append(f"requirepass {_conf_string(self.password)}")
        conf_path = Path(workdir, "redis.conf")
        conf_path.write_text("\n".join(conf) + "\n")
        log_path = Path(workdir, "redis.log")
        with open(log_path, "wb") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen([self.binary, str(conf_path)], stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=subprocess.STDOUT, cwd=workdir)
        self._finalizer = weakref.finalize(self, _terminate, self.proc, workdir, self.stop_timeout_s)
        # No client retries: this loop is the retry, and it must notice a dead child promptly.
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, retry=Retry(NoBackoff(), 0),
                             socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while True:
                try:  # the pid check guards against a foreign server that won the race for the port
                    if client.info("server").get("process_id") == self.proc.pid:
                        return self
                except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
                    pass
                if self.proc.poll() is not None:
                    why = f"exited with status {self.proc.returncode}"
                    break
                if time.monotonic() > deadline:
                    why = f"did not answer within {START_TIMEOUT_S:.0f} s"
                    break
                time.sleep(0.02)
        finally:
            client.close()
        output = log_path.read_text(errors="replace")[-2000:].strip()
        self.stop()
        raise RedisServerError(f"{self.binary} (port {self.port}) {why}; its output:\n{output or '(none)'}")

    def restart(self) -> EmbeddedRedis:
        """Start a server that died (or was stopped) again on the same port, so clients keep their URL."""
        self.stop()
        self._fixed_port = self.port
        return self.start(attempts=1)

    def stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # runs _terminate once; later calls do nothing

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
