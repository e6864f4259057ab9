"""Ray actor shim over DecodeWorker: streams a request's tokens as a Ray streaming generator."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import ray

from decode_worker.worker import DecodeWorker
from engine import EngineConfig, Role
from engine.faults import FaultInjector
from kv_transfer import KVTransferError, TransferConfig
from router.config import IndexLink
from router.streams import OutputStream
from router.types import Chunk, GenerateRequest, PrefillResult, Timing

log = logging.getLogger(__name__)


@ray.remote
class DecodeActor:
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 role: Role = Role.DECODE, index: IndexLink | None = None):
        transfer_cfg = transfer_cfg.on_node(ray.util.get_node_ip_address())
        self.worker = DecodeWorker(worker_id, engine_cfg, transfer_cfg, role, index)
        self.streams: dict[str, OutputStream] = {}  # requests streaming from here, for abort()
        self.ranks: list = []  # a tensor-parallel worker's other ranks (decode_worker.group.RankActor)
        self.faults = FaultInjector.from_env(self.worker.loop)  # chaos tests only

    async def attach_ranks(self, ranks: list) -> None:
        """Ranks 1..k-1 of this tensor-parallel worker: each receives its own KV heads."""
        self.ranks = ranks

    async def address(self) -> tuple[str, int] | list[tuple[str, int]]:
        """Where a prefill worker connects: one address, or one per rank of a TP worker."""
        if not self.ranks:
            return self.worker.address
        return [self.worker.address, *await asyncio.gather(*(r.address.remote() for r in self.ranks))]

    async def accept(self, expect: str | None = None) -> str:
        """Accept the next prefill worker, `expect` when given (on every rank of a TP worker); returns its id."""
        peers = await asyncio.gather(asyncio.to_thread(self.worker.accept, expect),
                                     *(r.accept.remote(expect) for r in self.ranks))
        if len(set(peers)) != 1:
            raise RuntimeError(f"the ranks of {self.worker.worker_id} accepted different peers: {peers}")
        return peers[0]

    async def reserve(self, request_id: str, num_tokens: int) -> bool:
        return await asyncio.to_thread(self.worker.reserve, request_id, num_tokens)

    async def generate(self, req: GenerateRequest, first: PrefillResult, prefill_id: str,
                       prefill: ray.actor.ActorHandle) -> AsyncIterator[Chunk]:
        """Pull the KV from `prefill`, then stream from the first token on. If the transfer
        fails, recompute the whole request here instead (same tokens: same model, and
        sampling is keyed by seed and position)."""
        timing = Timing()
        async with self._stream(req.request_id) as stream:
            try:
                loop = asyncio.get_running_loop()
                ask = lambda: asyncio.run_coroutine_threadsafe(  # from the pull thread, via our loop
                    _await(prefill.push.remote(req.request_id, self.worker.worker_id)), loop).result()
                nbytes, secs = await asyncio.to_thread(self.worker.pull, req.request_id, prefill_id, ask)
                timing.transfer_s, timing.transfer_bytes = secs, nbytes
                await asyncio.wrap_future(self.worker.start(
                    req.request_id, req.prompt_token_ids, first.first_token_id, req.params,
                    first.usage.cached_tokens, first.first_logprobs, stream.sink, req.cache_salt))
                yield Chunk(req.request_id, [first.first_token_id], first.text, timing=timing,
                            logprobs=[first.first_logprobs] if first.first_logprobs else None)
            except Exception as exc:
                if not (stream.aborted or isinstance(exc, KVTransferError)):
                    raise
                # After abort() (which frees the reservation and ends the stream) a pull or admit
                # may fail on the missing blocks: nothing to recompute then.
                if not stream.aborted:
                    log.warning("KV transfer for %s failed (%s); recomputing on %s", req.request_id, exc,
                                self.worker.worker_id)
                    timing.recomputed = True
                    await asyncio.to_thread(self.worker.abort, req.request_id)  # frees the reservation
                    await asyncio.wrap_future(self.worker.generate_local(req, stream.sink))
            first_chunk = timing.recomputed
            async for chunk in stream.chunks():
                if first_chunk:
                    chunk.timing, first_chunk = timing, False
                yield chunk

    async def generate_local(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """A whole request on this worker (colocated mode)."""
        async with self._stream(req.request_id) as stream:
            await asyncio.wrap_future(self.worker.generate_local(req, stream.sink))
            async for chunk in stream.chunks():
                yield chunk

    @contextlib.asynccontextmanager
    async def _stream(self, request_id: str) -> AsyncIterator[OutputStream]:
        """A request's output stream, known to abort() while it lasts; a request that leaves
        before its stream finished (cancelled, failed) is aborted here, freeing its KV."""
        stream = self.streams[request_id] = OutputStream()
        try:
            yield stream
        finally:
            self.streams.pop(request_id, None)
            if not stream.finished:
                await asyncio.to_thread(self.worker.abort, request_id)

    async def abort(self, request_id: str) -> None:
        """Free the request's blocks; a stream it has here ends with finish_reason "abort"."""
        stream = self.streams.get(request_id)
        if stream is not None:
            stream.aborted = True  # first: generate() must not recompute what is being aborted
        out = await asyncio.to_thread(self.worker.abort, request_id)
        if stream is not None:
            stream.end_aborted(request_id, out)

    async def inject_fault(self, kind: str) -> None:
        """Chaos tests only: refused unless the worker started with BRIGADE_FAULT_INJECTION=1 (engine/faults.py)."""
        self.faults.inject(kind)

    async def health(self) -> dict:
        return self.worker.health()

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.worker.stats)

    async def disconnect(self, prefill_id: str) -> None:
        """Close the pair with a prefill worker that left the cluster (on every rank of a TP worker)."""
        await asyncio.gather(asyncio.to_thread(self.worker.drop_channel, prefill_id),
                             *(r.disconnect.remote(prefill_id) for r in self.ranks))

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.worker.close)


async def _await(ref):
    return await ref
