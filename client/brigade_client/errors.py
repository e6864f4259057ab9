"""Typed exceptions for gRPC status codes: each carries the code and the server's message."""
from __future__ import annotations

import grpc

RETRY_AFTER_KEY = "retry-after-ms"  # trailing metadata the server sets on UNAVAILABLE / RESOURCE_EXHAUSTED
FIELD_KEY = "brigade-field"  # trailing metadata naming the invalid field on INVALID_ARGUMENT
STARTED_KEY = "brigade-started"  # trailing metadata: the request had produced tokens when it failed
TOKENS_SENT_KEY = "brigade-tokens-sent"  # trailing metadata: tokens streamed before the workers gave up


class BrigadeError(Exception):
    """A failed call. `code` is the grpc.StatusCode, `message` the server's details."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None,
                 field: str | None = None, started: bool = False, tokens_sent: int | None = None):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message, self.retry_after_s, self.field = code, message, retry_after_s, field
        self.started = started  # the server had produced tokens: retrying would run the request again
        self.tokens_sent = tokens_sent  # how many the stream delivered, when its workers died beyond migration


class InvalidArgument(BrigadeError):
    """The request can never run as given; `field` names the culprit."""


class Unauthenticated(BrigadeError):
    """No token, or one the server does not know."""


class ResourceExhausted(BrigadeError):
    """The router's queue is full, or the message is over the size limit."""


class Unavailable(BrigadeError):
    """No worker can serve now, or the server is draining: retry (the SDK does, before the first token)."""


class DeadlineExceeded(BrigadeError):
    """The call's timeout passed; the server aborted the work."""


class Cancelled(BrigadeError):
    pass


class NotFound(BrigadeError):
    pass


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.CANCELLED: Cancelled,
    grpc.StatusCode.NOT_FOUND: NotFound,
}


def from_rpc_error(exc: grpc.RpcError, trailers=None) -> BrigadeError:
    """The typed exception for a grpc.RpcError (sync) or grpc.aio.AioRpcError; async callers pass
    the trailers they awaited."""
    code, details = exc.code(), exc.details() or ""
    if trailers is None:
        trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else ()
    meta = {k: v for k, v in (trailers or ())}
    retry = meta.get(RETRY_AFTER_KEY)
    retry_after_s = int(retry) / 1000 if isinstance(retry, str) and retry.isdigit() else None
    sent = meta.get(TOKENS_SENT_KEY)
    return _BY_CODE.get(code, BrigadeError)(code, details, retry_after_s, meta.get(FIELD_KEY),
                                            meta.get(STARTED_KEY) == "1",
                                            int(sent) if isinstance(sent, str) and sent.isdigit() else None)
