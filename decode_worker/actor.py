"""Ray actor shim over DecodeWorker: its streams as Ray streaming generators, the rank fan-out
of a tensor-parallel worker; everything else delegates."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import ray

from decode_worker.worker import DecodeWorker
from engine import EngineConfig
from engine.messages import STREAM_WINDOW_CHUNKS, Chunk, GenerateRequest, KVHandle, PrefillResult
from kv_transfer import TransferConfig
from worker.base import PublisherFactory, WorkerActor


@ray.remote
class DecodeActor(WorkerActor):
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 publisher: PublisherFactory | None = None):
        transfer_cfg = transfer_cfg.on_node(ray.util.get_node_ip_address())
        self._serve(DecodeWorker(worker_id, engine_cfg, transfer_cfg, publisher))
        self.ranks: list = []  # a tensor-parallel worker's other ranks (decode_worker.group.RankActor)

    async def attach_ranks(self, ranks: list) -> None:
        """Ranks 1..k-1 of this tensor-parallel worker: each receives its own KV heads."""
        self.ranks = ranks

    async def address(self) -> tuple[str, int] | list[tuple[str, int]]:
        """Where a prefill worker connects: one address, or one per rank of a TP worker."""
        if not self.ranks:
            return self.worker.address
        return [self.worker.address, *await asyncio.gather(*(r.address.remote() for r in self.ranks))]

    async def accept(self, ticket: str, expect: str | None = None) -> str:
        """Accept the prefill worker joining under `ticket`, `expect` when given (on every rank of
        a TP worker: each rank's own store, the same ticket); returns its id."""
        peers = await asyncio.gather(asyncio.to_thread(self.worker.accept, ticket, expect),
                                     *(r.accept.remote(ticket, expect) for r in self.ranks))
        if len(set(peers)) != 1:
            raise RuntimeError(f"the ranks of {self.worker.worker_id} accepted different peers: {peers}")
        return peers[0]

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        return await asyncio.to_thread(self.worker.reserve, request_id, num_tokens, prefill_id)

    @ray.method(_generator_backpressure_num_objects=STREAM_WINDOW_CHUNKS)
    async def generate(self, req: GenerateRequest, first: PrefillResult, handle: KVHandle) -> AsyncIterator[Chunk]:
        """Take the KV the prefill worker sent for `handle`, then stream from the second token on
        (DecodeWorker.stream)."""
        async for chunk in self.worker.stream(req, first, handle):
            yield chunk

    @ray.method(_generator_backpressure_num_objects=STREAM_WINDOW_CHUNKS)
    async def generate_local(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """A whole request on this worker (colocated mode)."""
        async for chunk in self.worker.stream_local(req):
            yield chunk

    async def abort(self, request_id: str) -> None:
        await self.worker.cancel(request_id)

    async def disconnect(self, prefill_id: str) -> None:
        """Close the pair with a prefill worker that left the cluster (on every rank of a TP worker)."""
        await asyncio.gather(asyncio.to_thread(self.worker.drop_channel, prefill_id),
                             *(r.disconnect.remote(prefill_id) for r in self.ranks))
