"""The router's one seam to its workers: the `WorkerClient` protocol, and its Ray
implementation, the only place the router calls `.remote`.

Router code holds WorkerClients and never sees an actor handle, so its unit tests drive it
with plain async fakes and a fleet simulator can stand simulated workers behind it. A client
raises `WorkerLost` when the worker is gone (killed, crashed, its node or engine lost) rather
than because of the request: the router then migrates the request. What a worker does with
each call is documented on the worker classes (prefill_worker/, decode_worker/).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable
from typing import Protocol, TypeVar

from engine.engine_loop import EngineDied
from engine.messages import Chunk, GenerateRequest, KVHandle, PrefillResult, WorkerHealth
from router.errors import WorkerLost

T = TypeVar("T")
Address = tuple[str, int] | list[tuple[str, int]]


class WorkerClient(Protocol):
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"

    async def health(self) -> WorkerHealth: ...

    # -- one request --------------------------------------------------------------------
    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        """Decode: hold blocks for the prompt's KV from `prefill_id` before it is sent; the
        handle the prefill request carries, or None when full."""

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        """Prefill: compute the prompt; its KV leaves for the decode worker of `handle` as soon as
        it is exported (no handle: nobody takes it)."""

    def generate(self, req: GenerateRequest, first: PrefillResult | None = None,
                 handle: KVHandle | None = None) -> AsyncIterator[Chunk]:
        """Decode (with `first` and the `handle` reserve() gave): take the KV the prefill worker
        sent and stream from the second token on. Mixed (without): the whole request. The
        stream ends with a `finished` chunk."""

    async def abort(self, request_id: str) -> None:
        """Free the request's KV here; a stream it has here ends with finish_reason "abort"."""

    # -- pairing (disaggregated) --------------------------------------------------------
    async def address(self) -> Address:
        """Decode: where a prefill worker connects (one per rank of a TP worker)."""

    async def accept(self, ticket: str, expect: str | None = None) -> str:
        """Decode: accept the prefill worker that joins under `ticket` (only `expect`, when
        given: a join under another name is refused, kv_transfer.rendezvous); its id."""

    async def connect(self, decode_id: str, address: Address, ticket: str) -> None:
        """Prefill: open the KV pair with a decode worker under `ticket`, the one its accept()
        got (blocks until it accepts)."""

    async def disconnect(self, peer_id: str) -> None:
        """Close the pair with `peer_id`, if any."""

    async def stats(self) -> dict:
        """The engine's counters, for operators and benchmarks."""


def _cause(exc: BaseException) -> BaseException:
    # Imported here, not above: the router's own modules (and their unit tests) load no Ray.
    from ray.exceptions import RayTaskError

    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause  # a worker's own exception, as Ray hands it on
    return exc


def worker_died(exc: BaseException) -> bool:
    """A call failed because the worker is gone, not because of the request."""
    from ray.exceptions import ObjectLostError, RayActorError

    return isinstance(_cause(exc), (RayActorError, ObjectLostError, EngineDied))


def lost(worker_id: str, exc: BaseException) -> WorkerLost:
    """The WorkerLost for a worker-death `exc`, saying whether its engine failed a step."""
    return WorkerLost(worker_id, engine_died=isinstance(_cause(exc), EngineDied))


class RayWorker:
    """A WorkerClient over a worker's Ray actor (PrefillActor or DecodeActor, or rank 0 of a group)."""

    def __init__(self, worker_id: str, role: str, handle):
        self.worker_id, self.role, self.handle = worker_id, role, handle

    async def _call(self, call: Awaitable[T]) -> T:
        try:
            return await call
        except Exception as exc:
            if worker_died(exc):
                raise lost(self.worker_id, exc) from exc
            raise

    async def health(self) -> WorkerHealth:
        return await self._call(self.handle.health.remote())

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        return await self._call(self.handle.reserve.remote(request_id, num_tokens, prefill_id))

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        return await self._call(self.handle.prefill.remote(req, handle))

    async def generate(self, req: GenerateRequest, first: PrefillResult | None = None,
                       handle: KVHandle | None = None) -> AsyncIterator[Chunk]:
        if first is None:
            stream = self.handle.generate_local.remote(req)
        else:
            stream = self.handle.generate.remote(req, first, handle)
        try:
            async for ref in stream:
                yield await ref
        except Exception as exc:
            if worker_died(exc):
                raise lost(self.worker_id, exc) from exc
            raise

    async def abort(self, request_id: str) -> None:
        await self._call(self.handle.abort.remote(request_id))

    async def address(self) -> Address:
        return await self._call(self.handle.address.remote())

    async def accept(self, ticket: str, expect: str | None = None) -> str:
        return await self._call(self.handle.accept.remote(ticket, expect))

    async def connect(self, decode_id: str, address: Address, ticket: str) -> None:
        await self._call(self.handle.connect.remote(decode_id, address, ticket))

    async def disconnect(self, peer_id: str) -> None:
        await self._call(self.handle.disconnect.remote(peer_id))

    async def stats(self) -> dict:
        return await self._call(self.handle.stats.remote())
