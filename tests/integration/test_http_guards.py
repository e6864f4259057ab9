"""The HTTP door under hostile clients (issue 17), in-process over a stand-in backend: a trickle
that never finishes its headers, or its body, is cut off by a total deadline (a per-read timeout
alone would let it hold a thread forever); connections over frontdoor.max_connections get 503 at
once; and an answer still works when its socket's descriptor is above 1024 (no select())."""
from __future__ import annotations

import contextlib
import os
import socket
import time

import pytest
from support import wait_for
from test_http_api import post, start

from router.config import FrontDoorConfig

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def served(**frontdoor):
    server = start(FrontDoorConfig(**frontdoor))
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def connect(server) -> socket.socket:
    sock = socket.create_connection(server.server_address[:2], timeout=30)
    return sock


def closed_by_server(sock: socket.socket, trickle: bytes, every_s: float = 0.3, limit_s: float = 30.0) -> bool:
    """Send `trickle` a byte at a time; True once the server ends the connection."""
    deadline = time.monotonic() + limit_s
    for b in trickle * 1000:
        if time.monotonic() > deadline:
            return False
        try:
            sock.sendall(bytes([b]))
        except OSError:
            return True
        sock.settimeout(every_s)
        try:
            if sock.recv(4096) == b"":
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_headers_that_trickle_past_the_deadline_are_cut_off() -> None:
    with served(header_timeout_s=1.0) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        assert closed_by_server(sock, b"X-Slow: aaaaaaaa\r\n")
        sock.close()
        assert server.deadlines.reaped >= 1
        assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


def test_a_body_slower_than_the_minimum_rate_is_cut_off() -> None:
    with served(header_timeout_s=1.0, min_body_bytes_per_s=1000.0) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2000\r\n\r\n{")
        assert closed_by_server(sock, b" ")  # 2000 bytes at 1000 B/s after 1 s of grace: 3 s at most
        sock.close()
        assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


def test_connections_over_the_cap_get_503_at_once() -> None:
    with served(max_connections=3, header_timeout_s=60.0) as server:
        idle = [connect(server) for _ in range(3)]
        for s in idle:  # each holds a handler thread, waiting for its request line
            s.sendall(b"G")
        wait_for(lambda: server.cap.open >= 3, 20, "3 connections open", 0.02)
        extra = connect(server)
        extra.settimeout(10)
        reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in reply
        extra.close()
        for s in idle:
            s.close()
        wait_for(lambda: server.cap.open == 0, 20, "every connection closed", 0.02)
        assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200
        assert server.cap.refused == 1


def test_an_answer_on_a_descriptor_above_1024_works() -> None:
    fillers = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]  # the door's sockets land past 1024
    try:
        with served() as server:
            status, body, _ = post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})
            assert status == 200 and body["choices"][0]["text"] == "abc"  # checked the client between chunks
    finally:
        for fd in fillers:
            os.close(fd)
