"""One request's KV hand-off as a record with explicit states, owned by the decode-side connector.

    reserved ──▶ pulling ──▶ written ──▶ admitted        (the engine's sequence owns the blocks)
        │           │           │
        │           └──▶ failed ┤                          (bad checksum, refused, link lost: recompute)
        └───────────────────────┴──▶ aborted | stale       (cancelled | nobody came within hold_timeout_s)

`reserved`: blocks (and draft blocks) are held for the payload; `pulling`: the payload is being
written into them, and nothing may free them until it ends; `written`: the KV is in place,
waiting for the request's first token to admit it. Only the connector moves a Handoff, under
its lock; an illegal move is a bug and raises.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from engine.messages import GenerateRequest, KVHandle
from kv_transfer.errors import KVTransferError


class HandoffState(str, Enum):
    RESERVED = "reserved"
    PULLING = "pulling"
    WRITTEN = "written"
    ADMITTED = "admitted"
    FAILED = "failed"
    ABORTED = "aborted"
    STALE = "stale"


S = HandoffState
MOVES: dict[HandoffState, set[HandoffState]] = {
    S.RESERVED: {S.PULLING, S.FAILED, S.ABORTED, S.STALE},
    S.PULLING: {S.WRITTEN, S.FAILED},
    S.WRITTEN: {S.ADMITTED, S.ABORTED, S.STALE},
    S.FAILED: {S.ABORTED, S.STALE},
    S.ADMITTED: set(), S.ABORTED: set(), S.STALE: set(),
}
# Still holding blocks the engine has not taken over, and not being written: what a sweep may free.
IDLE = (S.RESERVED, S.WRITTEN, S.FAILED)


@dataclass
class Handoff:
    handle: KVHandle
    blocks: list[int]
    draft_blocks: list[int] | None = None  # draft blocks for a shipped draft KV (speculative "ship")
    reserved_at: float = field(default_factory=time.monotonic)
    state: HandoffState = S.RESERVED
    draft_written: bool = False  # the draft's prompt KV arrived into draft_blocks
    error: KVTransferError | None = None  # why it failed
    nbytes: int = 0  # payload bytes received, the draft's included
    transfer_s: float = 0.0  # from its header's arrival to the KV written
    request: GenerateRequest | None = None  # set when its decode stream starts waiting for it

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def move(self, to: HandoffState) -> None:
        if to not in MOVES[self.state]:
            raise RuntimeError(f"hand-off of {self.request_id!r}: no move from {self.state.value} to {to.value}")
        self.state = to

    def fail(self, error: KVTransferError) -> KVTransferError:
        self.move(S.FAILED)
        self.error = error
        return error
