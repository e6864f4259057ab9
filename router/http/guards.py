"""What keeps hostile clients from holding the HTTP door's threads: a cap on open connections
(the excess answered 503 at once, with no thread spent on it), and deadlines a slow client
cannot stretch — the request line and headers must all arrive within `header_timeout_s`, and a
body at `min_body_bytes_per_s` or faster, counted on the bytes that arrived after a grace of
`header_timeout_s` (never on the length a client declares: a body over `max_message_bytes` is
answered 413 at once) — where a per-read timeout alone lets a trickle of one byte every 59 s
hold a thread forever. One reaper thread enforces every deadline, by shutting
the late connection's socket (its handler's blocked read then ends)."""
from __future__ import annotations

import contextlib
import json
import select
import socket
import ssl
import threading
import time

REAP_INTERVAL_S = 0.5
_REFUSED = json.dumps({"error": {"message": "too many connections; retry shortly", "type": "server_error",
                                 "param": None, "code": "unavailable"}}).encode()
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
           b"Connection: close\r\nContent-Length: " + str(len(_REFUSED)).encode() + b"\r\n\r\n" + _REFUSED)


class ConnectionCap:
    """Counts open connections; `admit` says whether one more may have a thread."""

    def __init__(self, limit: int):
        self.limit, self.open, self.refused = limit, 0, 0
        self._lock = threading.Lock()

    def admit(self) -> bool:
        with self._lock:
            if self.open >= self.limit:
                self.refused += 1
                return False
            self.open += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.open -= 1


def refuse(sock: socket.socket) -> None:
    """A 503 written without blocking (plain TCP; a TLS client just sees the connection close)."""
    if not isinstance(sock, ssl.SSLSocket):
        with contextlib.suppress(OSError):
            sock.setblocking(False)
            sock.send(REFUSAL)


class Deadlines:
    """connection -> the moment it must be done reading; a reaper thread shuts late ones."""

    def __init__(self) -> None:
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.reaped = 0

    def start(self) -> None:
        """Started with serving, not at construction (no thread of ours before Ray's forks)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="http-deadlines", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def arm(self, conn: socket.socket, seconds: float) -> None:
        self.arm_until(conn, time.monotonic() + seconds)

    def arm_until(self, conn: socket.socket, when: float) -> None:
        """`when`: a time.monotonic() moment."""
        with self._lock:
            self._due[conn] = when

    def disarm(self, conn: socket.socket) -> None:
        with self._lock:
            self._due.pop(conn, None)

    def _run(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            now = time.monotonic()
            with self._lock:
                late = [c for c, t in self._due.items() if t < now]
                for c in late:
                    del self._due[c]
            for c in late:
                self.reaped += 1
                with contextlib.suppress(OSError):
                    c.shutdown(socket.SHUT_RDWR)


def readable(conn: socket.socket) -> bool:
    """Whether `conn` has something to read now: poll, not select (which fails above fd 1024)."""
    poller = select.poll()
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))
