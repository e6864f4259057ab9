"""The typed messages every package shares: what a door hands the router, what the router
hands a worker, and what comes back.

A request crosses two typed forms between a door and a worker: the door builds a
`GenerateRequest` (tokenized, checked), and a prefill worker answers with a `PrefillResult`
(the first token; its KV already on its way to the decode worker named by the request's
`KVHandle`). Tokens stream back as `Chunk`s, each built once and never changed; the last one
carries usage and `Timing`. A worker's health check answers a
`WorkerHealth`. Plain dataclasses: they cross Ray (pickled by Ray between our own
processes, never on a socket we open) and are converted to protobuf only at the gRPC edge.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.outputs import Usage
from engine.sampling import SamplingParams, TokenLogprobs

# How many Chunks a stream may run ahead of its reader at each hop (decode worker -> router ->
# door): past it the sender waits, so a client that reads slowly holds its request's admission
# slot instead of making the router and the door buffer its whole answer.
STREAM_WINDOW_CHUNKS = 16

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # engine/sampler.py _mix's multiplier
_GOLDEN_INV = pow(_GOLDEN, -1, 1 << 64)


class Aborted(RuntimeError):
    """The request was aborted before it produced a result."""


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None  # tenant isolation: prefixes are shared only under the same salt

    def continuation(self, sent: list[int], chars: int, request_id: str) -> GenerateRequest:
        """The request that produces what this one has left after `sent` (0 < len(sent) <
        max_tokens), of whose text the client has `chars` characters (router/migration.py
        explains the seed shift and the resumed text)."""
        params = self.params
        if params.seed is not None:
            params = dataclasses.replace(params, seed=shifted_seed(params.seed, len(sent)))
        params = dataclasses.replace(params, max_tokens=params.max_tokens - len(sent),
                                     resumed_tokens=len(sent), resumed_chars=chars)
        return dataclasses.replace(self, request_id=request_id, prompt_token_ids=[*self.prompt_token_ids, *sent],
                                   params=params)


def shifted_seed(seed: int, offset: int) -> int:
    """The seed whose output position p samples like `seed`'s position p + offset."""
    return (seed + offset * _GOLDEN_INV) & _MASK


@dataclass(frozen=True)
class KVHandle:
    """A decode worker's reservation of blocks for one request's KV (kv_transfer's Handoff),
    as it travels: the router hands it to the prefill worker with the request, so the KV goes
    to `decode_id` as soon as it is exported, and back to the decode worker to start it."""

    request_id: str
    prefill_id: str  # the only worker whose KV for this request the decode worker accepts
    decode_id: str
    num_tokens: int


@dataclass
class PrefillResult:
    """What a prefill worker returns once a request's first token exists. `kv_sent`: its KV
    is queued for the decode worker of the request's KVHandle (False: no handle, no pair with
    that worker, or the first token finished the request; the decode worker then recomputes)."""

    request_id: str
    first_token_id: int
    text: str
    finished: bool
    finish_reason: str | None
    usage: Usage
    first_logprobs: TokenLogprobs | None
    queue_s: float
    prefill_s: float
    kv_sent: bool = False

    def chunk(self) -> Chunk:
        """The stream's first chunk: sent to the client as soon as the prefill is done, before
        the KV moves (the last one too when the first token finished the request)."""
        return Chunk(self.request_id, [self.first_token_id], self.text, self.finished, self.finish_reason,
                     self.usage if self.finished else None,
                     [self.first_logprobs] if self.first_logprobs else None)


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


@dataclass(frozen=True)
class Chunk:
    """One piece of a response stream. The last has `finished`, a reason, usage and timing.
    Frozen: each hop that adds to it (the router names its workers) builds a new one with
    dataclasses.replace, so a chunk already handed on never changes under its reader."""

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


@dataclass(frozen=True)
class WorkerHealth:
    """What a worker's health check answers (unlocked reads of engine counters: a hint)."""

    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"
    alive: bool
    error: str | None = None
    model_id: str = ""
    block_size: int = 0
    free_blocks: int = 0
    running: int = 0  # the engine's running batch
    broken_pairs: tuple[str, ...] = ()  # peers whose KV link failed: the router rebuilds those pairs
    # Counterparts it has a working KV pair with: how a front that does not pair (role front) learns them.
    peers: tuple[str, ...] = ()
    index: dict | None = None  # the cache-event publisher's status, when the cluster has an index
    tp_size: int = 1
    ep_size: int = 1
