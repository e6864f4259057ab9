"""The router's errors, and the one table that says how each door answers them.

Every door looks an exception up in `ERRORS` (its class or the nearest base listed): the
HTTP status, the gRPC status code (by name: the grpc package stays at the gRPC door), the
metrics outcome, and whether a retry may succeed (429/503 get Retry-After, gRPC a trailing
retry-after-ms). Anything not listed is a bug: 500 / INTERNAL / "error", answered with
`internal_message` (a log id; the text, which may name paths or Ray's internals, goes to the
log only). A RequestFailed (one request failed in a worker's engine) is a 500 too, whose own
message is already safe: it names the stage and a log id.
"""
from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

from engine.engine_loop import RequestFailed
from engine.messages import Aborted
from engine.sampling import InvalidRequest

log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """The router's queue is full: retry later."""


class NoWorker(RuntimeError):
    """No live worker of a needed role: retry later."""


class DecodeFull(NoWorker):
    """Every decode worker paired with the prefill worker kept its KV pool full for longer than
    RouterConfig.decode_wait_s: retry later."""


class StreamBroken(NoWorker):
    """A request's workers died more often than RouterConfig.max_migrations allows, after
    `tokens_sent` tokens reached the client: retriable, and the client knows how far it got."""

    def __init__(self, tokens_sent: int, message: str):
        super().__init__(message)
        self.tokens_sent = tokens_sent

    def __reduce__(self):  # crosses Ray from the router actor to the front doors
        return type(self), (self.tokens_sent, str(self))


class WorkerLost(Exception):
    """A worker died under a request (or its stream ended without a last chunk): the request
    migrates. Raised by the WorkerClient (which knows what a dead worker looks like) and by
    dispatch; never leaves the router."""

    def __init__(self, worker_id: str, engine_died: bool = False):
        super().__init__(worker_id)
        self.worker_id = worker_id
        self.engine_died = engine_died  # its engine failed a step (not the process or node lost)


class PoisonRequest(RuntimeError):
    """A request was in the batch of two engine deaths in a row: likely what kills engines, so
    it is failed for good rather than migrated onto a third (not retriable)."""


class ModelNotFound(LookupError):
    """A request named a model this server does not serve."""

    def __init__(self, model: Any, served: str | None = None):
        tail = f"this server serves {served!r}" if served else "see the list of models"
        super().__init__(f"model {model!r:.80} is not served here; {tail}")


@dataclass(frozen=True)
class Answer:
    http_status: int
    grpc_code: str  # a grpc.StatusCode name
    outcome: str  # the metrics label both doors record
    retry: bool = False


# Most specific first: StreamBroken is a NoWorker, looked up before it.
ERRORS: dict[type[BaseException], Answer] = {
    InvalidRequest: Answer(400, "INVALID_ARGUMENT", "invalid"),
    ModelNotFound: Answer(404, "NOT_FOUND", "invalid"),
    Overloaded: Answer(429, "RESOURCE_EXHAUSTED", "overloaded", retry=True),
    StreamBroken: Answer(503, "UNAVAILABLE", "unavailable", retry=True),
    NoWorker: Answer(503, "UNAVAILABLE", "unavailable", retry=True),
    Aborted: Answer(500, "ABORTED", "cancelled"),
    RequestFailed: Answer(500, "INTERNAL", "error"),
    PoisonRequest: Answer(500, "INTERNAL", "error"),
}
INTERNAL = Answer(500, "INTERNAL", "error")


def internal_message(exc: BaseException) -> str:
    """What a client reads for a bug: a log id under which the exception is logged here."""
    log_id = uuid.uuid4().hex[:12]
    log.error("internal error (log id %s)", log_id, exc_info=exc)
    return f"internal error; the server logged it under id {log_id}"


def safe_text(exc: BaseException) -> str:
    """A listed exception's own message, without the traceback a Ray task error wraps it in."""
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc)


def answer(exc: BaseException) -> Answer:
    for cls, row in ERRORS.items():
        if isinstance(exc, cls):
            return row
    return INTERNAL
