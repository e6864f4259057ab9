"""Typed messages between the router, the workers and the front doors."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.outputs import Usage
from engine.sampling import SamplingParams, TokenLogprobs


class Overloaded(RuntimeError):
    """The router's queue is full: retry later."""


class NoWorker(RuntimeError):
    """No live worker of a needed role: retry later."""


class StreamBroken(NoWorker):
    """A request's workers died more often than RouterConfig.max_migrations allows, after
    `tokens_sent` tokens reached the client: retriable, and the client knows how far it got."""

    def __init__(self, tokens_sent: int, message: str):
        super().__init__(message)
        self.tokens_sent = tokens_sent

    def __reduce__(self):  # crosses Ray from the router actor to the front doors
        return type(self), (self.tokens_sent, str(self))


class Aborted(RuntimeError):
    """The request was aborted before it produced a result."""


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None  # tenant isolation: prefixes are shared only under the same salt
    session_id: str | None = None  # multi-turn affinity hint for routing
    priority: int = 0  # lower runs first when the router must choose


@dataclass
class PrefillResult:
    """What a prefill worker returns once a request's first token exists (its KV stays pinned
    there until a decode worker pulls it, unless the first token already finished it)."""

    request_id: str
    first_token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    first_logprobs: TokenLogprobs | None
    queue_s: float
    prefill_s: float


@dataclass
class Timing:
    queue_s: float = 0.0  # waiting for admission at the router and the prefill worker
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    recomputed: bool = False  # the transfer failed and the decode worker recomputed the prompt
    migrations: int = 0  # times the request moved to other workers after one died (router/migration.py)


@dataclass
class Chunk:
    """One piece of a response stream. The last has `finished`, a reason, usage and timing."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool = False
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] | None = None
    timing: Timing | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None
