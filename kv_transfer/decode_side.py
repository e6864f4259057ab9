"""The decode-side connector: every request's Handoff on a decode worker, from the reservation
to admission, and the pairs its KV arrives over.

Scheduler half (what the worker's engine must do, called on the engine's loop thread where it
touches the pool): `reserve` holds blocks and draft blocks and returns the KVHandle that
travels with the prefill request; `wait` blocks until that request's KV is written (or raises
why it will not be: then the worker recomputes); `admitted` hands the blocks to the engine's
sequence; `abort` and `take_stale` end a hand-off that will not be admitted (the worker then
frees its blocks in the engine).

Wire half: one ReceiverChannel per prefill worker and one receiving thread per channel. A
prefill worker sends as soon as it has exported, so headers arrive whenever, in the order that
worker exported; the thread takes each at once, refuses one that matches no hand-off reserved
for that worker (aborted, stale, never reserved), and otherwise writes the payload straight
from its receive buffer into the reserved blocks. Those blocks belong to no running sequence
until admission, so the engine's step never touches them, and abort() waits for a write in
progress before anything can reuse them. Between requests the thread waits for the next header
without a deadline: a prefill worker that leaves closes its end, which ends the wait.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import torch

from engine.block_pool import NoFreeBlocks
from engine.messages import GenerateRequest, KVHandle
from kv_transfer.channel import ReceiverChannel
from kv_transfer.config import TransferConfig
from kv_transfer.errors import ChecksumMismatch, KVTransferError, LayoutMismatch
from kv_transfer.handoff import IDLE, Handoff, HandoffState
from kv_transfer.header import TransferHeader
from kv_transfer.layout import HeadShard, KVLayout, check_draft
from kv_transfer.recv_buffers import ReceiveBuffers
from kv_transfer.rendezvous import TransferServer

log = logging.getLogger(__name__)
S = HandoffState
IDLE_WAIT_S = 365 * 24 * 3600.0  # a receiving thread's wait for the next header: until its pair closes
WAIT_SLICE_S = 0.05  # how often a waiting stream looks at its pair again


class DecodeEngine(Protocol):
    """What the connector asks of the decode worker's engine (LLMEngine implements it)."""

    runner: object  # a ParallelModelRunner's write_local takes the other ranks' heads (tensor parallel)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]: ...
    def reserve_draft(self, request_id: str, num_tokens: int) -> list[int] | None: ...
    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None: ...
    def write_draft_kv(self, block_ids: list[int], kv: torch.Tensor) -> None: ...


class DecodeConnector:
    def __init__(self, worker_id: str, engine: DecodeEngine, transfer_cfg: TransferConfig, layout: KVLayout,
                 shard: HeadShard | None, draft_layout: KVLayout | None):
        """`shard`: rank 0's heads of a tensor-parallel engine (its other ranks receive theirs
        over their own pairs inside engine.runner.write_local); None: all heads."""
        self.worker_id, self.engine, self.cfg = worker_id, engine, transfer_cfg
        self.layout, self.shard, self.draft_layout = layout, shard, draft_layout
        self.server = TransferServer(transfer_cfg)
        self.channels: dict[str, ReceiverChannel] = {}  # by prefill worker id
        self.buffers = ReceiveBuffers(int(transfer_cfg.recv_buffer_mib * 2**20))  # per channel, capped
        self.handoffs: dict[str, Handoff] = {}  # by request id, until admitted, aborted or stale
        self.changed = threading.Condition()  # guards handoffs and their states

    # -- scheduler half ------------------------------------------------------------------
    def reserve(self, engine: DecodeEngine, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        """On the engine's loop thread: blocks for the prompt's KV from `prefill_id`, and draft
        blocks when the draft's KV is shipped; None when the pool is full."""
        try:
            blocks = engine.reserve(request_id, num_tokens)
        except NoFreeBlocks:
            return None
        handle = KVHandle(request_id, prefill_id, self.worker_id, num_tokens)
        draft = engine.reserve_draft(request_id, num_tokens)  # None: the draft recomputes the prompt
        with self.changed:
            self.handoffs[request_id] = Handoff(handle, blocks, draft)
        return handle

    def wait(self, handle: KVHandle, req: GenerateRequest, kv_sent: bool = True) -> Handoff:
        """The request's hand-off once its KV is written. KVTransferError when it will not be:
        it failed on the wire, the prefill worker sent none (`kv_sent` False), the pair is gone,
        or no header came within transfer.timeout_s. The blocks stay held for abort()."""
        deadline = time.monotonic() + self.cfg.timeout_s
        with self.changed:
            while True:
                h = self.handoffs.get(handle.request_id)
                if h is None or h.handle != handle:
                    raise KVTransferError(f"no blocks reserved for {handle.request_id!r} (aborted or stale)")
                h.request = req
                if h.state is S.WRITTEN:
                    return h
                if h.state is S.FAILED:
                    raise h.error
                if h.state is S.RESERVED:
                    channel = self.channels.get(handle.prefill_id)
                    if not kv_sent:
                        raise h.fail(KVTransferError(f"{handle.prefill_id!r} sent no KV for {handle.request_id!r}"))
                    if channel is None or channel.broken:
                        raise h.fail(KVTransferError(f"no working pair with {handle.prefill_id!r}"))
                    if time.monotonic() > deadline:
                        raise h.fail(KVTransferError(f"the KV of {handle.request_id!r} did not arrive from "
                                                     f"{handle.prefill_id!r} within {self.cfg.timeout_s:g} s"))
                self.changed.wait(WAIT_SLICE_S)

    def admitted(self, handoff: Handoff) -> None:
        """The engine's sequence owns the blocks from here. KVTransferError if the hand-off ended
        meanwhile (an abort came first: the engine has freed or is freeing the blocks)."""
        with self.changed:
            if self.handoffs.get(handoff.request_id) is not handoff or handoff.state is not S.WRITTEN:
                raise KVTransferError(f"the hand-off of {handoff.request_id!r} ended before admission")
            handoff.move(S.ADMITTED)
            del self.handoffs[handoff.request_id]

    def abort(self, request_id: str) -> bool:
        """End the request's hand-off, after a write in progress; True if it held blocks (the
        caller frees them in the engine, as for any request there)."""
        with self.changed:
            self.changed.wait_for(lambda: getattr(self.handoffs.get(request_id), "state", None) is not S.PULLING)
            h = self.handoffs.pop(request_id, None)
            if h is not None:
                h.move(S.ABORTED)
                self.changed.notify_all()
            return h is not None

    def take_stale(self) -> list[str]:
        """End the hand-offs reserved longer than transfer.hold_timeout_s ago that are not being
        written (the router died between its calls, or their stream never came); their ids,
        whose blocks the caller frees in the engine."""
        deadline = time.monotonic() - self.cfg.hold_timeout_s
        with self.changed:
            stale = [h for h in self.handoffs.values() if h.reserved_at < deadline and h.state in IDLE]
            for h in stale:
                h.move(S.STALE)
                del self.handoffs[h.request_id]
            if stale:
                self.changed.notify_all()
        return [h.request_id for h in stale]

    # -- wire half -------------------------------------------------------------------------
    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def accept(self, ticket: str, expect: str | None = None) -> str:
        """Accept the prefill worker that joins under `ticket` (named `expect` when given); its id."""
        channel = self.server.accept(self.layout, self.shard, expect=expect, ticket=ticket)
        return self.attach(channel)

    def attach(self, channel: ReceiverChannel) -> str:
        """Receive over `channel` from its peer from now on, in place of an earlier pair with it."""
        channel.draft_layout = self.draft_layout
        old = self.channels.pop(channel.peer, None)
        if old is not None:
            old.close()
        self.channels[channel.peer] = channel
        threading.Thread(target=self._receive, args=(channel,), daemon=True,
                         name=f"{self.worker_id}-from-{channel.peer}").start()
        return channel.peer

    def drop(self, prefill_id: str) -> None:
        self.buffers.drop(prefill_id)
        channel = self.channels.pop(prefill_id, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        for prefill_id in list(self.channels):
            self.drop(prefill_id)
        self.server.close()

    def _receive(self, channel: ReceiverChannel) -> None:
        """Take every header `channel` delivers until it closes."""
        while not channel.broken:
            try:
                header = channel.recv_header(IDLE_WAIT_S)
            except LayoutMismatch as exc:  # refused already, before any payload
                self._fail(channel.peer, exc.request_id, exc)
                continue
            except KVTransferError as exc:
                if not channel.broken:  # an undecodable header, refused: nobody to tell
                    log.warning("%s: a header from %s was refused: %s", self.worker_id, channel.peer, exc)
                    continue
                break
            if channel.closed:  # closed here while it waited: the peer learns it from the missing ack
                break
            self._take(channel, header)
        with self.changed:
            self.changed.notify_all()  # streams waiting on this pair look again

    def _fail(self, peer: str, request_id: str | None, error: KVTransferError) -> None:
        with self.changed:
            h = self.handoffs.get(request_id or "")
            if h is not None and h.handle.prefill_id == peer and h.state is S.RESERVED:
                h.fail(error)
                self.changed.notify_all()

    def _take(self, channel: ReceiverChannel, header: TransferHeader) -> None:
        with self.changed:
            h = self.handoffs.get(header.request_id)
            wanted = h is not None and h.state is S.RESERVED and h.handle.prefill_id == channel.peer
            if wanted:
                h.move(S.PULLING)
        if not wanted:
            channel.refuse(header)
            log.info("%s: refused the KV of %r from %s: no reservation waits for it", self.worker_id,
                     header.request_id, channel.peer)
            return
        start, error = time.monotonic(), None
        try:
            h.nbytes = self._write(h, header, channel)
        except KVTransferError as exc:
            error = exc
        except Exception as exc:  # the engine's write failed: this request recomputes, the pair goes on
            log.exception("%s: writing the KV of %r failed", self.worker_id, header.request_id)
            error = KVTransferError(f"writing the KV of {header.request_id!r} failed: {exc!r}")
        with self.changed:
            h.transfer_s = time.monotonic() - start
            if error is None:
                h.move(S.WRITTEN)
            else:
                h.fail(error)
            self.changed.notify_all()

    def _write(self, h: Handoff, header: TransferHeader, channel: ReceiverChannel) -> int:
        """Receive the payload `header` announced into `h`'s blocks; the bytes received."""
        expected = (h.handle.num_tokens, len(h.blocks))
        if (header.num_tokens, header.num_blocks) != expected:  # refused before any buffer grows
            channel.refuse(header)
            raise KVTransferError(f"KV of {h.request_id!r} claims {header.num_tokens} tokens in "
                                  f"{header.num_blocks} blocks; {expected[0]} in {expected[1]} were reserved")
        draft_blocks = self._draft_blocks(h, header, channel)
        if self.shard is not None:
            self._write_group(h, header, channel)
            return header.payload_nbytes
        draft_out = channel.draft_buffer(header) if draft_blocks else None
        kv = channel.recv_payload(header, self._buffer(channel, header), draft_out=draft_out)
        self.engine.write_kv(h.blocks, kv)
        if draft_out is None:
            return header.payload_nbytes
        self.engine.write_draft_kv(draft_blocks, draft_out)
        h.draft_written = True
        return header.payload_nbytes + header.draft.payload_nbytes

    def _draft_blocks(self, h: Handoff, header: TransferHeader, channel: ReceiverChannel) -> list[int] | None:
        """The reserved draft blocks the header's draft KV goes into, or None to decline it (none
        reserved, none sent, another draft model). Counts that disagree with the reservation are
        refused, as the target's are, before anything is allocated."""
        blocks = h.draft_blocks
        if blocks is None or self.shard is not None or check_draft(header, channel.draft_layout) is not None:
            return None
        if (header.draft.num_tokens, header.draft.num_blocks) != (h.handle.num_tokens, len(blocks)):
            channel.refuse(header)
            raise KVTransferError(f"draft KV of {h.request_id!r} claims {header.draft.num_tokens} tokens in "
                                  f"{header.draft.num_blocks} blocks; {h.handle.num_tokens} in "
                                  f"{len(blocks)} were reserved")
        return blocks

    def _write_group(self, h: Handoff, header: TransferHeader, channel: ReceiverChannel) -> None:
        """Rank 0's heads from its pair, the other ranks' from theirs, all written in one group op.
        A bad checksum here still lets the other ranks take their pieces (into blocks about to be
        freed), so every pair stays in step for the next request."""
        from engine.parallel.runner import LocalKVFailed

        failure: KVTransferError | None = None
        try:
            kv = channel.recv_payload(header, self._buffer(channel, header))
        except ChecksumMismatch as exc:
            kv, failure = torch.zeros(header.payload_shape, dtype=header.dtype), exc
        try:
            self.engine.runner.write_local(h.request_id, header.num_tokens, h.blocks, kv, peer=channel.peer)
        except LocalKVFailed as exc:
            raise KVTransferError(f"a rank of {self.worker_id} did not get its KV of {h.request_id!r}: {exc}") from exc
        if failure is not None:
            raise failure

    def _buffer(self, channel: ReceiverChannel, header: TransferHeader) -> torch.Tensor:
        """A receive buffer for this channel, reused across requests up to the cap."""
        return self.buffers.view(channel.peer, header, channel.link.payload_device)
