"""One attempt at a request: colocated on one mixed worker, or disaggregated over a prefill
and a decode worker. Yields (chunk, prefill, decode) so the request loop can name the
workers in the last chunk; raises WorkerLost when a worker died under the attempt (the
request loop migrates it) and NoWorker when no worker can take it.

Disaggregated: reserve KV blocks on a decode worker paired with the chosen prefill worker,
then prefill with the reservation's handle (the prefill worker sends the KV to that decode
worker as soon as it is exported, while the first token leaves for the client), then the decode
worker takes the KV and streams from the second token on: three worker calls, none between
workers. max_tokens 1 needs no decode
worker at all. When every paired decode worker's pool is full, requests wait for blocks in
arrival order (up to RouterConfig.decode_wait_s), as an engine's waiting queue would, rather
than being refused while the decode workers are merely busy.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from engine.messages import Chunk, GenerateRequest, KVHandle, Timing
from router.errors import DecodeFull, NoWorker, WorkerLost
from router.policy import Picker
from router.pool import WorkerRef

log = logging.getLogger(__name__)
Attempt = AsyncIterator[tuple[Chunk, WorkerRef | None, WorkerRef | None]]
# A waiting request tries again whenever a decode stream of this router ends, and at least this
# often: blocks also free where this router does not see it (another front, a stale reservation).
RESERVE_POLL_S = 0.2


def abort_chunk(request_id: str) -> Chunk:
    return Chunk(request_id, [], "", True, "abort")


class Dispatch:
    def __init__(self, picker: Picker, colocated: bool, decode_wait_s: float = 30.0):
        self.picker, self.colocated, self.decode_wait_s = picker, colocated, decode_wait_s
        self._reserve_turn = asyncio.Lock()  # FIFO: held by the request waiting longest for decode blocks
        self._decode_freed = asyncio.Event()  # set when a decode stream here ends
        # request id -> (prefill, decode, the id the workers know it by: a migrated request's differs)
        self.active: dict[str, tuple[WorkerRef | None, WorkerRef | None, str]] = {}
        self.aborted: set[str] = set()  # active requests abort() was called for

    def attempt(self, req: GenerateRequest, key: str, timing: Timing, avoid: set[str]) -> Attempt:
        """One attempt at `req`, known to abort() as `key` (a migrated request's continuation
        has its own id at the workers), on workers not in `avoid`."""
        return self._colocated(req, key, avoid) if self.colocated else self._disaggregated(req, key, timing, avoid)

    async def abort(self, request_id: str) -> bool:
        """Stop an active request on its workers; its stream ends with finish_reason "abort"."""
        if request_id not in self.active:
            return False
        self.aborted.add(request_id)
        prefill, decode, worker_rid = self.active[request_id]
        calls = [w.client.abort(worker_rid) for w in (prefill, decode) if w is not None]
        await asyncio.gather(*calls, return_exceptions=True)
        return bool(calls)

    def forget(self, request_id: str) -> None:
        self.active.pop(request_id, None)
        self.aborted.discard(request_id)

    async def _colocated(self, req: GenerateRequest, key: str, avoid: set[str]) -> Attempt:
        worker, queued = await self.picker.prefill("mixed", req, avoid)
        self.active[key] = (None, worker, req.request_id)
        worker.inflight += 1
        worker.queued_tokens += queued
        try:
            async for chunk in self._from_worker(worker, worker.client.generate(req)):
                if queued and (chunk.token_ids or chunk.finished):  # the prompt is computed
                    worker.queued_tokens -= queued
                    queued = 0
                yield chunk, None, worker
        finally:
            worker.inflight -= 1
            worker.queued_tokens -= queued

    async def _disaggregated(self, req: GenerateRequest, key: str, timing: Timing, avoid: set[str]) -> Attempt:
        rid = req.request_id
        prefill, queued = await self.picker.prefill("prefill", req, avoid)
        prefill.inflight += 1  # counted from the pick on, so concurrent requests spread out
        prefill.queued_tokens += queued
        self.active[key] = (prefill, None, rid)
        prefilling, decode, handle = True, None, None
        try:
            # max_tokens 1: the prefill worker's first token is the whole answer, so no decode
            # worker is needed (nor a reservation that would hold its blocks through the prefill).
            if req.params.max_tokens > 1:
                decode, handle = await self._reserve(req, prefill, avoid)
            self.active[key] = (prefill, decode, rid)
            start = time.monotonic()
            try:
                first = await prefill.client.prefill(req, handle)
            except BaseException as exc:
                if decode is not None:
                    await _quietly(decode.client.abort(rid))  # frees the reservation
                if not (key in self.aborted and isinstance(exc, Exception)):
                    raise  # WorkerLost: retried elsewhere
                yield abort_chunk(rid), prefill, decode  # abort() ended the prefill
                return
            timing.prefill_s = time.monotonic() - start
            if key in self.aborted:  # while reserving, or before the prefill worker had the request
                await asyncio.gather(*(w.client.abort(rid) for w in (prefill, decode) if w is not None),
                                     return_exceptions=True)
                yield abort_chunk(rid), prefill, decode
                return
            if first.finished:  # the first token already ended it: nothing to transfer
                if decode is not None:
                    await _quietly(decode.client.abort(rid))
                yield first.chunk(), prefill, None
                return
            prefill.inflight -= 1
            prefill.queued_tokens -= queued
            prefilling = False
            try:
                yield first.chunk(), prefill, decode  # the first token, before the transfer
            except GeneratorExit:  # closed before the decode worker took the KV: free both holds now
                await asyncio.gather(prefill.client.abort(rid), decode.client.abort(rid), return_exceptions=True)
                raise
            async for chunk in self._from_worker(decode, decode.client.generate(req, first, handle)):
                if chunk.timing is not None:  # the decode worker's transfer report
                    timing.transfer_s, timing.transfer_bytes = chunk.timing.transfer_s, chunk.timing.transfer_bytes
                    timing.recomputed = chunk.timing.recomputed
                yield chunk, prefill, decode
        finally:
            if prefilling:
                prefill.inflight -= 1
                prefill.queued_tokens -= queued
            if decode is not None:
                decode.inflight -= 1
                self._decode_freed.set()

    async def _from_worker(self, worker: WorkerRef, stream: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
        """`worker`'s chunks; a stream that ends without a last chunk lost its worker too."""
        finished = False
        async for chunk in stream:
            finished = chunk.finished
            yield chunk
        if not finished:
            raise WorkerLost(worker.worker_id)

    async def _reserve(self, req: GenerateRequest, prefill: WorkerRef, avoid: set[str]) -> tuple[WorkerRef, KVHandle]:
        """A decode worker connected to `prefill` (and not in `avoid`) with blocks for the
        prompt's KV, and the reservation's handle; its inflight count already includes this
        request. Raises NoWorker if none is alive, DecodeFull if their pools stayed full for
        decode_wait_s."""
        if not self._reserve_turn.locked():  # nobody is waiting: no queue to respect
            got = await self._try_reserve(req, prefill, avoid)
            if got is not None:
                return got
        try:
            async with asyncio.timeout(self.decode_wait_s):
                async with self._reserve_turn:
                    while (got := await self._try_reserve(req, prefill, avoid)) is None:
                        self._decode_freed.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._decode_freed.wait(), RESERVE_POLL_S)
                    return got
        except TimeoutError:
            raise DecodeFull(f"every decode worker's KV cache stayed full for {self.decode_wait_s:g} s "
                             "(router.decode_wait_s); retry shortly") from None

    async def _try_reserve(self, req: GenerateRequest, prefill: WorkerRef,
                           avoid: set[str]) -> tuple[WorkerRef, KVHandle] | None:
        """One pass over the candidate decode workers; None if every live one is full."""
        tried: set[str] = set(avoid)
        full = False
        while True:
            try:
                decode = self.picker.decode(tried, prefill)
            except NoWorker:
                if full:
                    return None
                raise
            decode.inflight += 1  # before the await, as for the prefill pick
            try:
                handle = await decode.client.reserve(req.request_id, len(req.prompt_token_ids), prefill.worker_id)
                if handle is not None:
                    return decode, handle
                full = True
            except asyncio.CancelledError:
                decode.inflight -= 1
                # The reservation may have been made after all: free it now rather than at hold_timeout_s.
                asyncio.ensure_future(_quietly(decode.client.abort(req.request_id)))
                raise
            except Exception as exc:  # died since the last health check: stop routing there, try another
                log.warning("decode worker %s failed to reserve (%r); marking it unhealthy", decode.worker_id, exc)
                decode.healthy = False
            decode.inflight -= 1
            tried.add(decode.worker_id)


async def _quietly(call) -> None:
    """An abort whose worker may be gone already (then there is nothing to free)."""
    try:
        await call
    except WorkerLost:
        pass
