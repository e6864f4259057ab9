"""Plain async fakes of router.workers.WorkerClient (no Ray), and a router built over them.

`FakeWorker` answers every call of the protocol with a healthy default and records what it
was asked; tests subclass it for the behaviour they test (a stream that dies, a real engine
behind it). `router_over` hands the fakes straight to the pool, with no health loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.messages import Chunk, GenerateRequest, KVHandle, PrefillResult, WorkerHealth
from router.config import RouterConfig
from router.pool import WorkerRef
from router.router import Router


class FakeWorker:
    def __init__(self, worker_id: str, role: str = "mixed"):
        self.worker_id, self.role = worker_id, role
        self.requests: list[GenerateRequest] = []
        self.aborted: list[str] = []
        self.peers: list[str] = []  # the decode workers a prefill fake connected to
        self.expected: list[str | None] = []  # accept(expect=...) as the pool called it
        self.tickets: list[str] = []  # the pairing tickets the pool handed this fake (accept or connect)
        self._queue: asyncio.Queue | None = None

    async def health(self) -> WorkerHealth:
        return WorkerHealth(self.worker_id, self.role, alive=True, model_id="fake", block_size=16, free_blocks=64)

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        return KVHandle(request_id, prefill_id, self.worker_id, num_tokens)

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        raise NotImplementedError(f"{self.worker_id} does not prefill")

    async def generate(self, req: GenerateRequest, first: PrefillResult | None = None,
                       handle: KVHandle | None = None) -> AsyncIterator[Chunk]:
        raise NotImplementedError(f"{self.worker_id} does not generate")
        yield  # an async generator

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def address(self):
        return self  # a fake's address is the fake: connect() knocks on it directly

    async def accept(self, ticket: str, expect: str | None = None) -> str:
        self.expected.append(expect)  # whom the pool said to expect (the real one refuses others)
        self.tickets.append(ticket)
        return await self._callers().get()

    async def connect(self, decode_id: str, address, ticket: str) -> None:
        self.tickets.append(ticket)
        address._callers().put_nowait(self.worker_id)
        self.peers.append(decode_id)

    def _callers(self) -> asyncio.Queue:
        """Prefill workers that connected and are not accepted yet (made on the running loop)."""
        if self._queue is None:
            self._queue = asyncio.Queue()
        return self._queue

    async def disconnect(self, peer_id: str) -> None:
        pass

    async def stats(self) -> dict:
        return {}


def router_over(cfg: RouterConfig, *workers: FakeWorker, colocated: bool = True,
                peers: dict[str, set[str]] | None = None) -> Router:
    """A router whose pool holds `workers` (healthy; `peers`: their pairs), without pairing them."""
    router = Router(cfg, colocated=colocated)
    router.pool.workers = {w.worker_id: WorkerRef(w, peers=set((peers or {}).get(w.worker_id, ()))) for w in workers}
    return router
