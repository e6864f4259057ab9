"""One completion or chat request at the HTTP door, after auth and the body: parse it
(router/http/openai_format.py, which asks the backend to tokenize and validate), build the one
GenerateRequest, and relay the backend's async Chunk stream (through the server's loop
thread, router/http/bridge.py) as one JSON answer or as server-sent events.

Closing the backend's stream aborts its work and frees its KV: it is closed when the answer is
done, when it failed, and when the client left (a failed write; for a whole answer, EOF seen on
a plain-TCP socket between chunks).
"""
from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import closing
from typing import TYPE_CHECKING

from engine.messages import Chunk, GenerateRequest
from router.auth import cache_salt
from router.http.answers import api_error, error_body, outcome
from router.http.guards import readable
from router.http.openai_format import ChatShape, Collected, CompletionShape, parse_chat, parse_completion

if TYPE_CHECKING:
    from router.http.handler import Handler

# A write or read that fails this way means the client is gone: the request is cancelled.
CLIENT_GONE = (ConnectionError, TimeoutError, ssl.SSLError)
ROUTES = {"/v1/completions": (parse_completion, CompletionShape),
          "/v1/chat/completions": (parse_chat, ChatShape)}


class Record:
    """What one generation request leaves in the metrics."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.outcome = "error"
        self.ttft_s: float | None = None
        self.usage = None


def generate(handler: Handler, parse, shape_cls, body: dict, tenant: str, record: Record) -> None:
    backend = handler.live_backend()
    parsed = parse(body, backend)
    shape = shape_cls(backend, parsed)
    req = GenerateRequest(shape.id, parsed.prompt_ids, parsed.params, cache_salt(tenant, parsed.cache_salt))
    with closing(handler.server.bridge.iterate(backend.generate(req))) as chunks:
        first = next(chunks)  # admission errors surface here, before any header is sent
        record.ttft_s = time.monotonic() - record.start
        if parsed.stream:
            _stream(handler, shape, first, chunks, record)
        else:
            _whole(handler, shape, first, chunks, record)


def _whole(handler: Handler, shape: CompletionShape, first: Chunk, chunks: Iterator[Chunk], record: Record) -> None:
    got, last = Collected(), first
    got.add(first)
    while not last.finished:
        if client_gone(handler.connection):
            raise ConnectionResetError("the client closed the connection")  # cancelled: abort the work
        last = next(chunks)
        got.add(last)
    record.usage = last.usage
    handler.send_json(200, shape.whole(got, last.finish_reason, last.usage))
    record.outcome = "ok"


def _stream(handler: Handler, shape: CompletionShape, first: Chunk, chunks: Iterator[Chunk], record: Record) -> None:
    handler.send_response(200)
    handler.send_header("Content-Type", "text/event-stream")
    handler.send_header("Cache-Control", "no-cache")
    handler.end_headers()
    chunk = first
    try:
        for event in shape.opening():
            handler.send_event(event)
        while True:
            handler.send_event(shape.delta(chunk))
            if chunk.finished:
                break
            chunk = next(chunks)
        if shape.parsed.include_usage:
            handler.send_event(shape.usage_event(chunk.usage))
        handler.wfile.write(b"data: [DONE]\n\n")
        handler.wfile.flush()
        record.usage, record.outcome = chunk.usage, "ok"
    except CLIENT_GONE:
        raise  # do_POST records it; closing `chunks` aborts the request
    except Exception as exc:  # headers are out: report the failure in the stream
        error = api_error(exc)
        record.outcome = outcome(error)
        handler.send_event({"error": error_body(error)})


def client_gone(conn: socket.socket) -> bool:
    """Whether a plain-TCP client has closed its end (it sends nothing more after its
    request, so a readable socket with nothing to read means EOF). Not checked under TLS,
    where peeking is not possible; there a whole answer finishes before the loss shows."""
    if isinstance(conn, ssl.SSLSocket) or not readable(conn):
        return False
    try:
        return conn.recv(1, socket.MSG_PEEK) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
