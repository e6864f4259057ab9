"""Ray actor shim over Router: its workers arrive as actor handles and become RayWorkers."""
from __future__ import annotations

from collections.abc import AsyncIterator

import ray

from engine.messages import STREAM_WINDOW_CHUNKS, Chunk, GenerateRequest
from router.config import IndexLink, RouterConfig
from router.index.view import IndexView
from router.router import Router
from router.workers import RayWorker


@ray.remote
class RouterActor:
    def __init__(self, cfg: RouterConfig, colocated: bool, index: IndexLink | None = None, owns_pairs: bool = True):
        view = (IndexView(index.redis_url, index.index, cfg.index_timeout_s, cfg.recent_route_ttl_s)
                if index is not None else None)
        self.router = Router(cfg, colocated, view, owns_pairs)

    async def add_worker(self, role: str, worker_id: str, handle) -> None:
        await self.router.add_worker(RayWorker(worker_id, role, handle))

    async def remove_worker(self, worker_id: str) -> bool:
        return await self.router.remove_worker(worker_id)

    @ray.method(_generator_backpressure_num_objects=STREAM_WINDOW_CHUNKS)
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """Runs at most STREAM_WINDOW_CHUNKS ahead of its reader: a slow client's request keeps
        its admission slot until the client has read all but the last window of it (the slot is
        given back as the last chunk is made, Router.generate)."""
        async for chunk in self.router.generate(req):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        return await self.router.abort(request_id)

    async def set_policy(self, policy: str) -> None:
        """Switch the routing policy at run time (benchmarks compare policies on the same workers)."""
        self.router.cfg = RouterConfig.model_validate({**self.router.cfg.model_dump(), "policy": policy})

    async def worker_ids(self) -> list[str]:
        return sorted(self.router.pool.workers)

    async def status(self) -> dict:
        return self.router.status()

    async def stats(self) -> dict:
        """Every live worker's engine counters (blocks free, running, ...), by worker id."""
        out = {}
        for w in self.router.pool.workers.values():
            try:
                out[w.worker_id] = await w.client.stats()
            except Exception as exc:
                out[w.worker_id] = {"error": repr(exc)}
        return out
