"""The HTTP door under hostile clients, in-process over a stand-in backend: a trickle
that never finishes its headers, or its body, is cut off by a total deadline (a per-read timeout
alone would let it hold a thread forever); connections over frontdoor.max_connections get 503 at
once; and an answer still works when its socket's descriptor is above 1024 (no select())."""
from __future__ import annotations

import contextlib
import json
import logging
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


def refused_sending(sock: socket.socket, limit_s: float) -> bool:
    """Send 1 KiB every 0.1 s; True once the server has closed the connection (a send fails)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"x" * 1024)
        except OSError:
            return True
        time.sleep(0.1)
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


def test_a_body_declared_over_the_limit_is_answered_413_at_once_and_the_connection_closed() -> None:
    """The answer does not wait for the 64 MiB it declares (nor the time they would take at
    min_body_bytes_per_s): 413 before any of it is read, then a short drain and the close."""
    with served(max_message_bytes=4096, header_timeout_s=30.0, min_body_bytes_per_s=1000.0) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {64 << 20}\r\n\r\n".encode() + b'{"prompt": "')
        sock.settimeout(10)
        reply = sock.makefile("rb").read()  # the whole answer, then the door's end of the stream
        assert reply.startswith(b"HTTP/1.0 413") and b"max_message_bytes" in reply, reply[:80]
        assert refused_sending(sock, limit_s=10.0)  # it goes on sending; the door stops reading and closes
        sock.close()
        assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


def test_a_trickled_body_is_cut_off_for_what_arrived_not_for_what_it_declared() -> None:
    """1,000,000 bytes declared (within the limit) would be 1,000 s at 1,000 B/s: the deadline
    follows the bytes received instead, so a trickle of a few bytes a second ends after the grace."""
    with served(max_message_bytes=2 << 20, header_timeout_s=1.0, min_body_bytes_per_s=1000.0) as server:
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000000\r\n\r\n{")
        assert closed_by_server(sock, b" ", limit_s=20.0)
        sock.close()
        assert server.deadlines.reaped >= 1
        assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


def test_a_body_that_pauses_within_its_grace_is_read_whole() -> None:
    with served(header_timeout_s=5.0, min_body_bytes_per_s=1000.0) as server:
        body = json.dumps({"prompt": "ok", "max_tokens": 3}).encode()
        sock = connect(server)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body[:5])
        time.sleep(1.0)
        sock.sendall(body[5:])
        sock.settimeout(30)
        assert sock.makefile("rb").read().startswith(b"HTTP/1.0 200")
        sock.close()


def nested(depth: int) -> object:
    """`depth` levels of arrays, innermost an empty one."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("field", ["messages", "tools", "documents", "chat_template_kwargs"])
def test_a_body_nested_deeper_than_32_levels_is_refused_at_the_door(field: str, caplog, capfd) -> None:
    """500 levels in 1.25 KB: refused naming the field before anything recurses over it (the
    chat template's walk hit the recursion limit), with nothing logged."""
    with served() as server:
        body = {"messages": [{"role": "user", "content": "x"}], field: nested(500)}
        assert len(json.dumps(body)) < 2000
        status, err, _ = post(f"{server.url}/v1/chat/completions", body)
        assert status == 400 and err["error"]["param"] == field and "32 levels" in err["error"]["message"]
        assert not server.backend.calls
    assert "Traceback" not in capfd.readouterr().err
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_32_levels_pass_the_door_and_33_do_not() -> None:
    with served() as server:
        url = f"{server.url}/v1/completions"
        assert post(url, {"prompt": "ok", "max_tokens": 3, "user": nested(31)})[0] == 200  # 32 with the body
        status, err, _ = post(url, {"prompt": "ok", "max_tokens": 3, "user": nested(32)})
        assert status == 400 and err["error"]["param"] == "user"


def test_a_bug_is_logged_once(caplog, capfd) -> None:
    """A 500 is one log record, with its log id and traceback; not a second traceback on stderr."""
    with served() as server:
        server.backend.fail = RuntimeError("boom")
        status, err, _ = post(f"{server.url}/v1/completions", {"prompt": "hi"})
    assert status == 500 and "logged it under id" in err["error"]["message"]
    logged = [r for r in caplog.records if r.exc_info]
    assert len(logged) == 1 and "internal error (log id" in logged[0].getMessage()
    assert "Traceback" not in capfd.readouterr().err
