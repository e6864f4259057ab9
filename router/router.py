"""Admission and dispatch: least-loaded prefill and decode workers, token streams back.

Disaggregated: reserve KV blocks on a decode worker, prefill on a prefill worker (first
token), then the decode worker pulls the KV and streams from the first token on.
Colocated: one mixed worker runs the whole request. Workers are Ray actor handles.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from router.config import RouterConfig
from router.types import Chunk, GenerateRequest, NoWorker, Overloaded, Timing

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerRef:
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"
    handle: object  # ray.actor.ActorHandle
    inflight: int = 0
    healthy: bool = True
    peers: set[str] = field(default_factory=set)  # connected counterpart ids


class Router:
    def __init__(self, cfg: RouterConfig, colocated: bool):
        self.cfg = cfg
        self.colocated = colocated
        self.workers: dict[str, WorkerRef] = {}
        self.waiting = 0
        self.running = 0
        self._slots = asyncio.Semaphore(cfg.max_running)
        self._active: dict[str, tuple[WorkerRef | None, WorkerRef | None]] = {}
        self._aborted: set[str] = set()  # active requests abort() was called for
        self._health_task: asyncio.Task | None = None

    # -- membership ---------------------------------------------------------------
    async def add_worker(self, role: str, worker_id: str, handle) -> None:
        """Register a worker; in disaggregated mode connect it to every counterpart first."""
        ref = WorkerRef(worker_id, role, handle)
        if not self.colocated:
            other = "decode" if role == "prefill" else "prefill"
            for w in [w for w in self.workers.values() if w.role == other]:  # one accept at a time per server
                await (self._pair(ref, w) if role == "prefill" else self._pair(w, ref))
        self.workers[worker_id] = ref
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def _pair(self, prefill: WorkerRef, decode: WorkerRef) -> None:
        address = await decode.handle.address.remote()
        accepted, _ = await asyncio.gather(decode.handle.accept.remote(),
                                           prefill.handle.connect.remote(decode.worker_id, address))
        if accepted != prefill.worker_id:
            raise RuntimeError(f"{decode.worker_id} accepted {accepted!r} while pairing {prefill.worker_id!r}")
        prefill.peers.add(decode.worker_id)
        decode.peers.add(prefill.worker_id)

    def live(self, role: str) -> list[WorkerRef]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def _pick(self, role: str, exclude: set[str] = frozenset(), peer_of: WorkerRef | None = None) -> WorkerRef:
        pool = [w for w in self.live(role) if w.worker_id not in exclude
                and (peer_of is None or w.worker_id in peer_of.peers)]
        if not pool:
            raise NoWorker(f"no live {role} worker can take the request; retry shortly")
        return min(pool, key=lambda w: w.inflight)

    # -- requests -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        if self.waiting >= self.cfg.max_waiting and self._slots.locked():
            raise Overloaded(f"overloaded: {self.waiting} requests waiting; retry later")
        arrived = time.monotonic()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        timing = Timing(queue_s=time.monotonic() - arrived)
        try:
            source = self._colocated(req) if self.colocated else self._disaggregated(req, timing)
            first = True
            async for chunk, prefill, decode in source:
                if first and chunk.token_ids:
                    timing.ttft_s, first = time.monotonic() - arrived, False
                if chunk.finished:
                    timing.total_s = time.monotonic() - arrived
                    chunk.timing = timing
                    chunk.prefill_worker = prefill.worker_id if prefill else None
                    chunk.decode_worker = decode.worker_id if decode else None
                else:
                    chunk.timing = None
                yield chunk
        finally:
            self.running -= 1
            self._slots.release()
            self._active.pop(req.request_id, None)
            self._aborted.discard(req.request_id)

    async def _colocated(self, req: GenerateRequest):
        worker = self._pick("mixed")
        self._active[req.request_id] = (None, worker)
        worker.inflight += 1
        try:
            async for ref in worker.handle.generate_local.remote(req):
                yield await ref, None, worker
        finally:
            worker.inflight -= 1

    async def _disaggregated(self, req: GenerateRequest, timing: Timing):
        rid = req.request_id
        prefill = self._pick("prefill")
        prefill.inflight += 1  # counted from the pick on, so concurrent requests spread out
        self._active[rid] = (prefill, None)
        prefilling, decode = True, None
        try:
            decode = await self._reserve(req, prefill)
            self._active[rid] = (prefill, decode)
            start = time.monotonic()
            try:
                first = await prefill.handle.prefill.remote(req)
            except BaseException as exc:
                await decode.handle.abort.remote(rid)  # frees the reservation
                if not (rid in self._aborted and isinstance(exc, Exception)):
                    raise
                yield _abort_chunk(rid), prefill, decode  # abort() ended the prefill
                return
            timing.prefill_s = time.monotonic() - start
            if rid in self._aborted:  # while reserving, or before the prefill worker had the request
                await asyncio.gather(prefill.handle.abort.remote(rid), decode.handle.abort.remote(rid))
                yield _abort_chunk(rid), prefill, decode
                return
            if first.finished:  # the first token already ended it: nothing to transfer
                await decode.handle.abort.remote(rid)
                yield Chunk(rid, [first.first_token_id], first.text, True, first.finish_reason,
                            first.usage, [first.first_logprobs] if first.first_logprobs else None), prefill, None
                return
            prefill.inflight -= 1
            prefilling = False
            async for ref in decode.handle.generate.remote(req, first, prefill.worker_id, prefill.handle):
                chunk = await ref
                if chunk.timing is not None:  # the decode worker's transfer report
                    timing.transfer_s, timing.transfer_bytes = chunk.timing.transfer_s, chunk.timing.transfer_bytes
                    timing.recomputed = chunk.timing.recomputed
                yield chunk, prefill, decode
        finally:
            if prefilling:
                prefill.inflight -= 1
            if decode is not None:
                decode.inflight -= 1

    async def _reserve(self, req: GenerateRequest, prefill: WorkerRef):
        """A decode worker connected to `prefill` with blocks for the prompt's KV; its
        inflight count already includes this request."""
        tried: set[str] = set()
        while True:
            decode = self._pick("decode", tried, peer_of=prefill)
            decode.inflight += 1  # before the await, as for the prefill pick
            try:
                if await decode.handle.reserve.remote(req.request_id, len(req.prompt_token_ids)):
                    return decode
            except asyncio.CancelledError:
                decode.inflight -= 1
                raise
            except Exception as exc:  # died since the last health check: stop routing there, try another
                log.warning("decode worker %s failed to reserve (%s); marking it unhealthy", decode.worker_id, exc)
                decode.healthy = False
            decode.inflight -= 1
            tried.add(decode.worker_id)

    async def abort(self, request_id: str) -> bool:
        """Stop an active request on its workers; its stream ends with finish_reason "abort"."""
        if request_id not in self._active:
            return False
        self._aborted.add(request_id)
        prefill, decode = self._active[request_id]
        calls = [w.handle.abort.remote(request_id) for w in (prefill, decode) if w is not None]
        await asyncio.gather(*calls, return_exceptions=True)
        return bool(calls)

    # -- health ---------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            await asyncio.gather(*(self._check(w) for w in list(self.workers.values())))

    async def _check(self, worker: WorkerRef) -> None:
        try:
            report = await asyncio.wait_for(worker.handle.health.remote(), self.cfg.health_timeout_s)
            healthy = bool(report.get("alive"))
        except Exception:  # dead actor, timeout: both mean do not route here
            healthy = False
        if healthy != worker.healthy:
            log.warning("worker %s is now %s", worker.worker_id, "healthy" if healthy else "UNHEALTHY")
        worker.healthy = healthy

    def status(self) -> dict:
        return {"waiting": self.waiting, "running": self.running, "colocated": self.colocated,
                "workers": {w.worker_id: {"role": w.role, "healthy": w.healthy, "inflight": w.inflight}
                            for w in self.workers.values()}}


def _abort_chunk(request_id: str) -> Chunk:
    return Chunk(request_id, [], "", True, "abort")
