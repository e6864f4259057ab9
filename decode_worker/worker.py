"""A decode worker: an engine that continues requests whose KV arrives from prefill workers.

Per request the decode-side connector (kv_transfer.decode_side) owns its Handoff: reserve()
allocates blocks before anything is sent (or refuses, so the router picks another worker) and
returns the KVHandle the router hands the prefill worker with the request; that worker sends
the KV as soon as it exists, and the connector's receiving thread writes it into the blocks,
checked by layout and checksum. start(handoff, first_token, sink) admits the request from its
first token and streams its outputs to a sink. With speculative.draft_kv "ship" reserve() also
reserves draft blocks, and the draft model's prompt KV that comes with the target's goes into
them (when the header's draft section matches this worker's draft and its counts the
reservation), so the draft proposes from the first step; otherwise the draft computes the
prompt itself. generate_local() runs a whole request here (colocated mode).

stream() does that for one request on an asyncio loop and yields its chunks from the second
token on (the router sent the first from the prefill result); when the transfer fails it
recomputes here instead, as a continuation after the first token (same tokens: same model,
sampling keyed by seed and position). The Ray actor only delegates to it.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future

from decode_worker.streams import OutputStream
from engine import EngineConfig, LLMEngine, RequestOutput, Role
from engine.engine_loop import Sink
from engine.messages import Chunk, GenerateRequest, KVHandle, PrefillResult, Timing
from engine.parallel.runner import ParallelModelRunner
from kv_transfer import HeadShard, KVLayout, KVTransferError, TransferConfig
from kv_transfer.decode_side import DecodeConnector
from kv_transfer.handoff import Handoff
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
        self.kv = DecodeConnector(worker_id, self.engine, transfer_cfg, self.layout, self.shard, self.draft_layout)
        self.streams: dict[str, OutputStream] = {}  # requests streaming from here, for cancel()
        self.sweeper = LeaseSweeper(self.free_stale_reservations,
                                    LeaseSweeper.interval_for(transfer_cfg.hold_timeout_s), f"{worker_id}-leases")

    @property
    def address(self) -> tuple[str, int]:
        return self.kv.address

    @property
    def channels(self) -> dict:
        return self.kv.channels

    def accept(self, ticket: str, expect: str | None = None) -> str:
        """Accept the prefill worker that joins under `ticket` (with the cluster's secret, and
        named `expect` when given: the router hands out both); returns its id."""
        return self.kv.accept(ticket, expect)

    def drop_channel(self, prefill_id: str) -> None:
        self.kv.drop(prefill_id)

    def free_stale_reservations(self) -> list[str]:
        """Free blocks reserved longer than transfer.hold_timeout_s ago for a request that was
        never admitted (a hand-off being written is never stale: its own timeouts bound it)."""
        stale = self.kv.take_stale()
        for rid in stale:
            self.loop.abort(rid).result()
            log.warning("freed the blocks reserved for %s: it was never admitted", rid)
        return stale

    def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        """Blocks for the prompt's KV from `prefill_id`; the handle that travels with the prefill
        request, or None when the pool is full."""
        self.free_stale_reservations()
        return self.loop.call(lambda engine: self.kv.reserve(engine, request_id, num_tokens, prefill_id)).result()

    def start(self, handoff: Handoff, first_token: PrefillResult, sink: Sink) -> Future[None]:
        """Admit a request whose KV is written into its reserved blocks (the hand-off `wait`
        returned); its outputs go to `sink`."""
        req, rid = handoff.request, handoff.request_id

        def admit(engine: LLMEngine) -> None:
            self.kv.admitted(handoff)  # the engine's sequence owns the blocks from here
            self.loop.watch_now(rid, sink)
            try:
                engine.admit(rid, req.prompt_token_ids, first_token.first_token_id, req.params,
                             first_token.usage.cached_tokens, first_token.first_logprobs, req.cache_salt,
                             draft_kv=handoff.draft_written)
            except BaseException:
                self.loop.unwatch_now(rid)
                raise
        return self.loop.call(admit)

    def generate_local(self, req: GenerateRequest, sink: Sink) -> Future[None]:
        # the door checked the request when it built it: the engine checks only what needs its pool
        return self.loop.add_request(req.request_id, req.prompt_token_ids, req.params, sink, req.cache_salt,
                                     checked=True)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Free the request's blocks, wherever it is; its final ("abort") output, or None when
        the engine held no running request (only a reservation, or nothing)."""
        self.kv.abort(request_id)  # after a write in progress: never free blocks being written
        return self.loop.abort(request_id).result()

    def broken_pairs(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if ch.broken)

    def peers(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if not ch.broken)

    def stats(self) -> dict:
        return super().stats() | {"channels": sorted(self.channels)}

    def close(self) -> None:
        self.sweeper.stop()
        self.kv.close()
        self.close_engine()

    # -- one request, on the caller's asyncio loop ----------------------------------------
    async def stream(self, req: GenerateRequest, first: PrefillResult, handle: KVHandle) -> AsyncIterator[Chunk]:
        """Wait for the request's KV (the prefill worker sent it as it exported it), admit the
        request and yield its chunks after the first token; the first yielded carries the
        transfer's Timing. A failed transfer recomputes the request here instead."""
        timing = Timing()
        async with self._stream(req.request_id) as stream:
            try:
                handoff = await asyncio.to_thread(self.kv.wait, handle, req, first.kv_sent)
                timing.transfer_s, timing.transfer_bytes = handoff.transfer_s, handoff.nbytes
                await asyncio.wrap_future(self.start(handoff, first, stream.sink))
            except Exception as exc:
                if not (stream.aborted or isinstance(exc, KVTransferError)):
                    raise
                # After cancel() (which frees the reservation and ends the stream) a wait or admit
                # may fail on the missing hand-off: nothing to recompute then.
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
            report: Timing | None = timing
            async for chunk in stream.chunks():
                usage = chunk.usage
                if timing.recomputed and usage is not None:  # as if the original request ran here
                    usage = dataclasses.replace(
                        usage, prompt_tokens=len(req.prompt_token_ids), completion_tokens=usage.completion_tokens + 1,
                        cached_tokens=min(usage.cached_tokens, len(req.prompt_token_ids)))
                if report is not None or usage is not chunk.usage:
                    chunk = dataclasses.replace(chunk, timing=report, usage=usage)
                report = None
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


def rank_shard(engine: LLMEngine) -> HeadShard | None:
    """The KV heads this (rank 0) engine holds when it is tensor parallel; None when it holds all."""
    runner = engine.runner
    if not isinstance(runner, ParallelModelRunner) or runner.plan.tp_size == 1:
        return None
    return shard_of(engine.model_config.num_kv_heads, runner.plan.tp_size, runner.group.rank)
