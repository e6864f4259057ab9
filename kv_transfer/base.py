"""The transfer interface: a sender side and a receiver side of one prefill/decode pair.

Modelled on vLLM v1's KV connector, much smaller. vLLM splits a connector into a scheduler
side (decide what to load, where it goes) and a worker side (move the bytes). Here the
channels below are the wire; the scheduler half, and each request's Handoff, live in the
connectors (decode_side.py, prefill_side.py), whose decision sits between two calls:

    prefill worker (sender)                   decode worker (receiver, blocks reserved first)
    export = engine.export_kv(rid)
    tx.send(rid, export.kv, export.num_tokens) ─ header ─▶ h = rx.recv_header()   # checked vs its layout
                                                          no hand-off reserved for it: rx.refuse(h)
                                         ◀── ack ───────  kv = rx.recv_payload(h)   # accept, receive, verify
                  (payload only on accept) ─ payload ──▶  engine.write_kv(blocks, kv); later engine.admit(...)

The prompt, first token and sampling params travel with the request's control message
(Ray), not here: this package moves KV bytes and the layout facts needed to trust them.

Ownership: a channel owns its link (process groups or queues) and closes it; the caller
owns every tensor it passes in or gets back. A channel carries one request at a time and is
used from one thread at a time; pairs are independent, so different pairs may run in
different threads. Any timeout or transport error closes the channel (ChannelClosed);
refusals and checksum mismatches do not.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import torch

from kv_transfer.errors import RefuseReason
from kv_transfer.header import TransferHeader


class Msg(IntEnum):
    """The three messages of one request, in order; values double as gloo tags."""

    HEADER = 1
    ACK = 2
    PAYLOAD = 3


class Link(Protocol):
    """An ordered point-to-point pipe between the two ends of one pair. `recv` fills a
    preallocated tensor of exactly the size sent. Errors: TransferTimeout after
    `timeout_s`, ChannelClosed when the peer is gone; either leaves the link closed."""

    payload_device: torch.device  # where payload tensors must live to go over this link
    closed: bool  # by close() or by the first failure

    def send(self, tensor: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None: ...
    def recv(self, out: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None: ...
    def close(self) -> None: ...


@dataclass
class ChannelStats:
    """Counters a channel keeps for its caller's metrics; only the channel changes them."""

    requests: int = 0
    accepted: int = 0
    refused: int = 0
    payloads: int = 0  # payloads actually sent (sender) or received (receiver)
    payload_bytes: int = 0
    checksum_failures: int = 0


class KVSender(Protocol):
    """The prefill side of a pair."""

    stats: ChannelStats
    corrupt_next_payload: bool  # test hook: flip one payload byte after the checksum is taken
    broken: bool  # closed, or its link failed: the pair must be rebuilt

    def send(self, request_id: str, kv: torch.Tensor, num_tokens: int,
             timeout_s: float | None = None, draft_kv: torch.Tensor | None = None) -> TransferHeader:
        """Send one request's KV: kv (2, L, nb, bs, head_count, hd), only read. Returns the
        header sent. TransferRefused if the receiver declined (no payload was sent, the
        channel stays usable); LayoutMismatch if kv does not match this sender's layout.
        `draft_kv`: a draft model's KV of the same tokens (speculative decoding), sent after it
        unless the receiver declines it (channel.py)."""
        ...

    def close(self) -> None: ...


class KVReceiver(Protocol):
    """The decode side of a pair. After `recv_header` returns, the caller must call exactly
    one of `recv_payload` or `refuse` for that header (the sender is waiting for the ack)."""

    stats: ChannelStats
    broken: bool  # closed, or its link failed: the pair must be rebuilt

    def recv_header(self, timeout_s: float | None = None) -> TransferHeader:
        """Wait for the next request's header and check it against this receiver's layout.
        A header that does not decode or does not fit is refused at once (the sender gets the
        reason and sends no payload) and raised as HeaderError / LayoutMismatch."""
        ...

    def refuse(self, header: TransferHeader, reason: RefuseReason = RefuseReason.CALLER) -> None:
        """Decline a checked header (e.g. no free blocks); no payload follows."""
        ...

    def recv_payload(self, header: TransferHeader, out: torch.Tensor | None = None,
                     timeout_s: float | None = None, draft_out: torch.Tensor | None = None) -> torch.Tensor:
        """Accept the header and receive its payload into `out` (contiguous,
        header.payload_shape, header.dtype, on the link's payload device; allocated when None),
        then verify it. ChecksumMismatch means the bytes in `out` must not be used. With
        `draft_out` the header's draft payload is taken too (else declined)."""
        ...

    def close(self) -> None: ...
