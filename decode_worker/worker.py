"""A decode worker: an engine that continues requests whose KV arrives from prefill workers.

Per request: reserve() allocates blocks before anything is sent (or refuses, so the router
picks another worker); pull() asks the prefill worker to send (through a callable the
caller supplies, so this class knows no Ray) and receives the KV straight into a buffer,
checked by layout and checksum; start() admits the request from its first token and
streams its outputs to a sink. With speculative.draft_kv "ship" reserve() also reserves draft
blocks, and pull() takes the draft model's prompt KV that comes with the target's into them
(when the header's draft section matches this worker's draft and its counts the reservation),
so the draft proposes from the first step; otherwise the draft computes the prompt itself.
generate_local() runs a whole request here (colocated mode).

stream() does all of that for one request on an asyncio loop and yields its chunks from the
second token on (the router sent the first from the prefill result); when the transfer
fails it recomputes here instead, as a continuation after the first token (same tokens:
same model, sampling keyed by seed and position). The Ray actor only delegates to it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Future

import torch

from decode_worker.streams import OutputStream
from engine import EngineConfig, LLMEngine, RequestOutput, Role, SamplingParams
from engine.block_pool import NoFreeBlocks
from engine.engine_loop import Sink
from engine.messages import Chunk, GenerateRequest, PrefillResult, Timing
from engine.parallel.runner import LocalKVFailed, ParallelModelRunner
from engine.sampling import TokenLogprobs
from kv_transfer import (
    ChecksumMismatch,
    HeadShard,
    KVLayout,
    KVTransferError,
    ReceiveBuffers,
    ReceiverChannel,
    TransferConfig,
    TransferServer,
    check_draft,
)
from kv_transfer.layout import draft_layout
from kv_transfer.leases import LeaseSweeper
from kv_transfer.reshard import shard_of
from worker.base import EngineWorker, PublisherFactory

log = logging.getLogger(__name__)


class DecodeWorker(EngineWorker):
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 publisher: PublisherFactory | None = None):
        """`engine_cfg.role` is DECODE, or MIXED for a colocated worker (whole requests only)."""
        if engine_cfg.role == Role.PREFILL:
            raise ValueError(f"{worker_id}: a decode worker's engine runs in decode or mixed role, not prefill")
        super().__init__(worker_id, engine_cfg, publisher)
        self.layout = KVLayout.of_model(self.engine.model_id, self.engine.runner.kv_cache,
                                        self.engine.model_config.num_kv_heads)
        # A tensor-parallel worker takes only rank 0's heads here; its other ranks receive their
        # own over their own pairs (decode_worker.group.RankActor, kv_transfer.reshard).
        self.shard = rank_shard(self.engine)
        self.draft_layout = draft_layout(self.engine)
        self.transfer_cfg = transfer_cfg
        self.server = TransferServer(transfer_cfg)
        self.channels: dict[str, ReceiverChannel] = {}  # by prefill worker id
        self.locks: dict[str, threading.Lock] = {}  # one transfer at a time per channel
        self.buffers = ReceiveBuffers(int(transfer_cfg.recv_buffer_mib * 2**20))  # per channel, capped
        self.reserved: dict[str, list[int]] = {}  # request id -> its reserved blocks
        self.reserved_at: dict[str, float] = {}
        self.reserved_tokens: dict[str, int] = {}  # what a pulled header must say, before any allocation
        self.draft_reserved: dict[str, list[int]] = {}  # request id -> draft blocks for its draft KV
        self.draft_written: set[str] = set()  # requests whose draft KV arrived into those blocks
        self.pulling: set[str] = set()  # requests whose KV is being written into their blocks
        self.pull_done = threading.Condition()
        self.streams: dict[str, OutputStream] = {}  # requests streaming from here, for cancel()
        self.sweeper = LeaseSweeper(self.free_stale_reservations,
                                    LeaseSweeper.interval_for(transfer_cfg.hold_timeout_s), f"{worker_id}-leases")

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def accept(self, ticket: str, expect: str | None = None) -> str:
        """Accept the prefill worker that joins under `ticket` (with the cluster's secret, and
        named `expect` when given: the router hands out both); returns its id."""
        channel = self.server.accept(self.layout, self.shard, expect=expect, ticket=ticket)
        channel.draft_layout = self.draft_layout
        self.locks.setdefault(channel.peer, threading.Lock())
        old = self.channels.pop(channel.peer, None)
        if old is not None:
            old.close()
        self.channels[channel.peer] = channel
        return channel.peer

    def drop_channel(self, prefill_id: str) -> None:
        self.buffers.drop(prefill_id)
        channel = self.channels.pop(prefill_id, None)
        if channel is not None:
            channel.close()

    def free_stale_reservations(self) -> list[str]:
        """Free blocks reserved longer than transfer.hold_timeout_s ago for a payload that
        never arrived (a pull in progress is never stale: its own timeouts bound it)."""
        deadline = time.monotonic() - self.transfer_cfg.hold_timeout_s
        stale = [rid for rid, t in list(self.reserved_at.items()) if t < deadline and rid not in self.pulling]
        for rid in stale:
            self.abort(rid)
            log.warning("freed the blocks reserved for %s: its KV never arrived", rid)
        return stale

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        self.free_stale_reservations()

        def reserve(engine: LLMEngine) -> bool:
            try:
                self.reserved[request_id] = engine.reserve(request_id, num_tokens)
                self.reserved_at[request_id] = time.monotonic()
                self.reserved_tokens[request_id] = num_tokens
                draft = engine.reserve_draft(request_id, num_tokens)  # None: the draft recomputes
                if draft is not None:
                    self.draft_reserved[request_id] = draft
                return True
            except NoFreeBlocks:
                return False
        return self.loop.call(reserve).result()

    def pull(self, request_id: str, prefill_id: str, request_push: Callable[[], bool]) -> tuple[int, float]:
        """Receive a reserved request's KV from `prefill_id` into its blocks.

        `request_push()` makes the prefill worker send (True) or says it cannot (False).
        Returns (payload bytes, the draft's included, seconds). Raises KVTransferError on refusal,
        a bad checksum or a closed channel; the reservation is then still held, for a retry or abort().
        """
        channel = self.channels.get(prefill_id)
        if channel is None:
            raise KVTransferError(f"no channel from {prefill_id!r}")
        start = time.monotonic()
        blocks = self.reserved.get(request_id)
        if blocks is None:
            raise KVTransferError(f"no blocks reserved for {request_id!r}")
        with self.pull_done:
            self.pulling.add(request_id)
        nbytes = 0
        try:
            with self.locks[prefill_id]:
                if not request_push():
                    raise KVTransferError(f"{prefill_id!r} does not hold {request_id!r}")
                header = channel.recv_header(self.transfer_cfg.timeout_s)
                if header.request_id != request_id:  # cannot happen while pulls are serialised per channel
                    channel.refuse(header)
                    raise KVTransferError(f"expected KV of {request_id!r}, got {header.request_id!r}")
                expected = (self.reserved_tokens.get(request_id), len(blocks))
                if (header.num_tokens, header.num_blocks) != expected:  # refused before any buffer grows
                    channel.refuse(header)
                    raise KVTransferError(f"KV of {request_id!r} claims {header.num_tokens} tokens in "
                                          f"{header.num_blocks} blocks; {expected[0]} in {expected[1]} were reserved")
                draft_blocks = self._draft_blocks(request_id, header, channel)
                # Written from this thread, not the engine's: reserved blocks belong to no running
                # sequence until admit(), so the step never touches them, and abort() waits for
                # us (below) before it can hand them to anyone else.
                if self.shard is None:
                    draft_out = channel.draft_buffer(header) if draft_blocks else None
                    kv = channel.recv_payload(header, self._buffer(prefill_id, header), draft_out=draft_out)
                    self.engine.write_kv(blocks, kv)
                    if draft_out is not None:
                        self.engine.write_draft_kv(draft_blocks, draft_out)
                        self.draft_written.add(request_id)
                        nbytes += header.draft.payload_nbytes
                else:
                    self._write_group(request_id, prefill_id, header, channel, blocks)
        finally:
            with self.pull_done:
                self.pulling.discard(request_id)
                self.pull_done.notify_all()
        return nbytes + header.payload_nbytes, time.monotonic() - start

    def _draft_blocks(self, request_id: str, header, channel: ReceiverChannel) -> list[int] | None:
        """The reserved draft blocks the header's draft KV goes into, or None to decline it (none
        reserved, none sent, another draft model). Counts that disagree with the reservation are
        refused, as the target's are, before anything is allocated."""
        blocks = self.draft_reserved.get(request_id)
        if blocks is None or self.shard is not None or check_draft(header, channel.draft_layout) is not None:
            return None
        if (header.draft.num_tokens, header.draft.num_blocks) != (self.reserved_tokens.get(request_id), len(blocks)):
            channel.refuse(header)
            raise KVTransferError(f"draft KV of {request_id!r} claims {header.draft.num_tokens} tokens in "
                                  f"{header.draft.num_blocks} blocks; {self.reserved_tokens.get(request_id)} in "
                                  f"{len(blocks)} were reserved")
        return blocks

    def _write_group(self, request_id: str, prefill_id: str, header, channel, blocks: list[int]) -> None:
        """Rank 0's heads from its pair, the other ranks' from theirs, all written in one group op.
        A bad checksum here still lets the other ranks take their pieces (into blocks about to be
        freed), so every pair stays in step for the next request."""
        failure: KVTransferError | None = None
        try:
            kv = channel.recv_payload(header, self._buffer(prefill_id, header))
        except ChecksumMismatch as exc:
            kv, failure = torch.zeros(header.payload_shape, dtype=header.dtype), exc
        try:
            self.engine.runner.write_local(request_id, header.num_tokens, blocks, kv, peer=prefill_id)
        except LocalKVFailed as exc:
            raise KVTransferError(f"a rank of {self.worker_id} did not get its KV of {request_id!r}: {exc}") from exc
        if failure is not None:
            raise failure

    def _buffer(self, prefill_id: str, header) -> torch.Tensor:
        """A receive buffer for this channel, reused across requests up to the cap."""
        return self.buffers.view(prefill_id, header, self.channels[prefill_id].link.payload_device)

    def start(self, request_id: str, prompt_token_ids: list[int], first_token_id: int, params: SamplingParams,
              cached_tokens: int, first_logprobs: TokenLogprobs | None, sink: Sink,
              cache_salt: str | None = None) -> Future[None]:
        """Admit a request whose KV is in its reserved blocks; its outputs go to `sink`."""
        def admit(engine: LLMEngine) -> None:
            self.reserved.pop(request_id, None)  # the engine's sequence owns the blocks from here
            self.reserved_at.pop(request_id, None)
            self.reserved_tokens.pop(request_id, None)
            self.draft_reserved.pop(request_id, None)
            draft_kv = request_id in self.draft_written
            self.draft_written.discard(request_id)
            self.loop.watch_now(request_id, sink)
            try:
                engine.admit(request_id, prompt_token_ids, first_token_id, params, cached_tokens, first_logprobs,
                             cache_salt, draft_kv=draft_kv)
            except BaseException:
                self.loop.unwatch_now(request_id)
                raise
        return self.loop.call(admit)

    def generate_local(self, req: GenerateRequest, sink: Sink) -> Future[None]:
        # the door checked the request when it built it: the engine checks only what needs its pool
        return self.loop.add_request(req.request_id, req.prompt_token_ids, req.params, sink, req.cache_salt,
                                     checked=True)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks, wherever it is; its final ("abort") output, or None when
        the engine held no running request (only a reservation, or nothing)."""
        with self.pull_done:  # never free blocks a pull is still writing into
            self.pull_done.wait_for(lambda: request_id not in self.pulling)
        self.reserved.pop(request_id, None)
        self.reserved_at.pop(request_id, None)
        self.reserved_tokens.pop(request_id, None)
        self.draft_reserved.pop(request_id, None)
        self.draft_written.discard(request_id)
        return self.loop.abort(request_id).result()

    def broken_pairs(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if ch.broken)

    def peers(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if not ch.broken)

    def stats(self) -> dict:
        return super().stats() | {"channels": sorted(self.channels)}

    def close(self) -> None:
        self.sweeper.stop()
        for prefill_id in list(self.channels):
            self.drop_channel(prefill_id)
        self.server.close()
        self.close_engine()

    # -- one request, on the caller's asyncio loop ----------------------------------------
    async def stream(self, req: GenerateRequest, first: PrefillResult, prefill_id: str,
                     request_push: Callable[[], Awaitable[bool]]) -> AsyncIterator[Chunk]:
        """Pull the KV from `prefill_id` (`request_push()` asks it to send), admit the request
        and yield its chunks after the first token; the first yielded carries the transfer's
        Timing. A failed transfer recomputes the request here instead."""
        timing = Timing()
        async with self._stream(req.request_id) as stream:
            loop = asyncio.get_running_loop()
            ask = lambda: asyncio.run_coroutine_threadsafe(_awaited(request_push()), loop).result()  # noqa: E731
            try:
                nbytes, secs = await asyncio.to_thread(self.pull, req.request_id, prefill_id, ask)
                timing.transfer_s, timing.transfer_bytes = secs, nbytes
                await asyncio.wrap_future(self.start(
                    req.request_id, req.prompt_token_ids, first.first_token_id, req.params,
                    first.usage.cached_tokens, first.first_logprobs, stream.sink, req.cache_salt))
            except Exception as exc:
                if not (stream.aborted or isinstance(exc, KVTransferError)):
                    raise
                # After cancel() (which frees the reservation and ends the stream) a pull or admit
                # may fail on the missing blocks: nothing to recompute then.
                if not stream.aborted:
                    log.warning("KV transfer for %s failed (%s); recomputing on %s", req.request_id, exc,
                                self.worker_id)
                    timing.recomputed = True
                    await asyncio.to_thread(self.abort, req.request_id)  # frees the reservation
                    await asyncio.wrap_future(self.generate_local(_after_first(req, first), stream.sink))
                    if stream.aborted:
                        # cancel() came while the request was being added, and its abort may have
                        # run first: the request would run unread, held by backpressure for good.
                        await asyncio.to_thread(self.abort, req.request_id)
            first_chunk = True
            async for chunk in stream.chunks():
                if first_chunk:
                    chunk.timing, first_chunk = timing, False
                if timing.recomputed and chunk.usage is not None:  # as if the original request ran here
                    chunk.usage = dataclasses.replace(
                        chunk.usage, prompt_tokens=len(req.prompt_token_ids),
                        completion_tokens=chunk.usage.completion_tokens + 1,
                        cached_tokens=min(chunk.usage.cached_tokens, len(req.prompt_token_ids)))
                yield chunk

    async def stream_local(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """A whole request on this worker (colocated mode)."""
        async with self._stream(req.request_id) as stream:
            await asyncio.wrap_future(self.generate_local(req, stream.sink))
            async for chunk in stream.chunks():
                yield chunk

    @contextlib.asynccontextmanager
    async def _stream(self, request_id: str) -> AsyncIterator[OutputStream]:
        """A request's output stream, known to cancel() while it lasts; a request that leaves
        before its stream finished (cancelled, failed) is aborted here, freeing its KV."""
        hold = lambda held: self.loop.call(lambda engine: engine.hold(request_id, held))  # noqa: E731
        stream = self.streams[request_id] = OutputStream(hold)
        try:
            yield stream
        finally:
            self.streams.pop(request_id, None)
            if not stream.finished:
                await asyncio.to_thread(self.abort, request_id)

    async def cancel(self, request_id: str) -> None:
        """Free the request's blocks; a stream it has here ends with finish_reason "abort"."""
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.aborted = True  # first: stream() must not recompute what is being aborted
        out = await asyncio.to_thread(self.abort, request_id)
        if stream is not None:
            stream.end_aborted(request_id, out)


def _after_first(req: GenerateRequest, first: PrefillResult) -> GenerateRequest:
    """What is left of `req` once its first token (and text) reached the client: recomputed
    here under the same id, so the client's stream goes on from its second token."""
    return req.continuation([first.first_token_id], len(first.text), req.request_id)


async def _awaited(awaitable: Awaitable):
    return await awaitable


def rank_shard(engine: LLMEngine) -> HeadShard | None:
    """The KV heads this (rank 0) engine holds when it is tensor parallel; None when it holds all."""
    runner = engine.runner
    if not isinstance(runner, ParallelModelRunner) or runner.plan.tp_size == 1:
        return None
    return shard_of(engine.model_config.num_kv_heads, runner.plan.tp_size, runner.group.rank)
