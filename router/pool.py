"""The worker pool: membership, prefill/decode pairing, and the health loop.

Each worker is a WorkerClient (router/workers.py) with the router's view of it beside
(`WorkerRef`: load counters, health, connected counterparts). Disaggregated, every healthy
prefill worker is paired with every healthy decode worker: when either joins, when a pair's
KV link failed (the health report names it), and at each health check for pairs still
missing. Each pairing gets a fresh random ticket that the router hands both sides, so their
rendezvous reads nothing a stranger could have planted (kv_transfer.rendezvous). The pool is
a hint like the index: a worker that died since the last check is found out by the request
that tries it.

Pairs belong to one router: the owner's (the `brigade serve` that started the workers). The
router of an extra front (`role: front`, cluster/front.py) routes over the same workers
without pairing or unpairing anything (`owns_pairs=False`): it takes each worker's pairs from
its health report, so two routers never race to build or close the same pair.
"""
from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

from engine.messages import WorkerHealth
from router.config import RouterConfig
from router.errors import NoWorker
from router.index.view import IndexView
from router.workers import WorkerClient

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerRef:
    client: WorkerClient
    inflight: int = 0
    queued_tokens: int = 0  # prompt tokens routed here whose prefill has not finished (kv_aware's queue)
    routed: int = 0  # requests routed here so far (spreads new conversations over idle workers)
    free_blocks: int = 0  # from the last health check
    running: int = 0  # the engine's running batch, from the last health check
    healthy: bool = True
    peers: set[str] = field(default_factory=set)  # connected counterpart ids

    @property
    def worker_id(self) -> str:
        return self.client.worker_id

    @property
    def role(self) -> str:
        return self.client.role

    def note(self, report: WorkerHealth) -> None:
        self.free_blocks, self.running = report.free_blocks, report.running


class WorkerPool:
    def __init__(self, cfg: RouterConfig, colocated: bool, index: IndexView | None = None, owns_pairs: bool = True):
        self.cfg, self.colocated, self.index, self.owns_pairs = cfg, colocated, index, owns_pairs
        self.workers: dict[str, WorkerRef] = {}
        self._health_task: asyncio.Task | None = None
        self._repair: asyncio.Task | None = None  # _pair_missing, one at a time
        self._pairing = asyncio.Lock()  # one accept at a time per transfer server

    # -- membership ---------------------------------------------------------------------
    async def add(self, client: WorkerClient) -> None:
        """Register a worker; disaggregated, connect it to every healthy counterpart first."""
        ref = WorkerRef(client)
        if self.owns_pairs:
            report = await client.health()
        else:  # another router started it: it may still be starting, or dying
            report = await asyncio.wait_for(client.health(), self.cfg.health_timeout_s)
            ref.peers = set(report.peers)
        ref.note(report)
        if self.index is not None and client.role in ("prefill", "mixed"):
            self.index.bind(report.model_id, report.block_size)
        if not self.colocated and self.owns_pairs:
            other = "decode" if client.role == "prefill" else "prefill"
            # Healthy ones only: a dead counterpart would hold the pairing until its timeout.
            async with self._pairing:
                for w in [w for w in self.workers.values() if w.role == other and w.healthy]:
                    await (self._pair(ref, w) if client.role == "prefill" else self._pair(w, ref))
        self.workers[client.worker_id] = ref
        if self.index is not None:
            await self.index.refresh()  # its lease, so the first request already sees its cache
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def remove(self, worker_id: str) -> bool:
        """Forget a worker (dead, or being replaced): no request is routed to it from now on,
        and its counterparts close their pairs with it. False if it was not registered."""
        ref = self.workers.pop(worker_id, None)
        if ref is None:
            return False
        peers = [w for w in self.workers.values() if worker_id in w.peers]
        for w in peers:
            w.peers.discard(worker_id)
        if not self.owns_pairs:
            return True
        await asyncio.gather(*(asyncio.wait_for(w.client.disconnect(worker_id), self.cfg.health_timeout_s)
                               for w in peers), return_exceptions=True)
        return True

    def live(self, role: str) -> list[WorkerRef]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def candidates(self, role: str, exclude: set[str] = frozenset(), peer_of: WorkerRef | None = None,
                   needs_peer: bool = False) -> list[WorkerRef]:
        """Live workers of `role`; with `peer_of`, only its counterparts; with `needs_peer`, only
        prefill workers paired with a live decode worker (else their prefill leads nowhere)."""
        decoders = {w.worker_id for w in self.live("decode")} if needs_peer else set()
        pool = [w for w in self.live(role) if w.worker_id not in exclude
                and (peer_of is None or w.worker_id in peer_of.peers)
                and (not needs_peer or bool(w.peers & decoders))]
        if not pool:
            raise NoWorker(f"no live {role} worker can take the request; retry shortly")
        return pool

    # -- pairing ------------------------------------------------------------------------
    async def _pair(self, prefill: WorkerRef, decode: WorkerRef) -> None:
        address = await decode.client.address()
        # The pairing's ticket goes to both sides over Ray, never through the decode worker's
        # rendezvous store, which anyone who reaches its port may write (kv_transfer.rendezvous).
        ticket = secrets.token_urlsafe(16)
        accepted, _ = await asyncio.gather(decode.client.accept(ticket, expect=prefill.worker_id),
                                           prefill.client.connect(decode.worker_id, address, ticket))
        if accepted != prefill.worker_id:
            raise RuntimeError(f"{decode.worker_id} accepted {accepted!r} while pairing {prefill.worker_id!r}")
        prefill.peers.add(decode.worker_id)
        decode.peers.add(prefill.worker_id)

    async def _pair_missing(self) -> None:
        """Pair healthy prefill and decode workers that are not paired yet: a worker that was
        unhealthy when a counterpart joined (or replaced one) would otherwise never be paired."""
        for decode in self.live("decode"):
            for prefill in [p for p in self.live("prefill") if decode.worker_id not in p.peers]:
                if prefill.worker_id not in self.workers or decode.worker_id not in self.workers:
                    continue  # removed meanwhile
                try:
                    async with self._pairing:
                        await self._pair(prefill, decode)
                    log.info("paired %s with %s", prefill.worker_id, decode.worker_id)
                except Exception as exc:  # tried again at the next health check
                    log.warning("pairing %s with %s failed: %r", prefill.worker_id, decode.worker_id, exc)

    async def _unpair_broken(self, worker: WorkerRef, broken: tuple[str, ...]) -> None:
        """Close both ends of each pair whose KV link failed (a reset, a timeout, a stream that
        lost step): no request is routed over it from now on, and _pair_missing builds a new one.
        Meanwhile a request already on it is recomputed by its decode worker."""
        for peer_id in set(broken) & worker.peers:
            peer = self.workers.get(peer_id)
            worker.peers.discard(peer_id)
            ends = [(worker, peer_id)]
            if peer is not None:
                peer.peers.discard(worker.worker_id)
                ends.append((peer, worker.worker_id))
            log.warning("the KV link between %s and %s failed; rebuilding the pair", worker.worker_id, peer_id)
            await asyncio.gather(*(asyncio.wait_for(w.client.disconnect(other), self.cfg.health_timeout_s)
                                   for w, other in ends), return_exceptions=True)

    # -- health -------------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self._health_round()
            except Exception:  # whatever broke this round, the next one must still eject dead workers
                log.exception("health check round failed; the next runs in %s s", self.cfg.health_interval_s)

    async def _health_round(self) -> None:
        checks = [self._check(w) for w in list(self.workers.values())]
        results = await asyncio.gather(*checks, *([self.index.refresh()] if self.index is not None else []),
                                       return_exceptions=True)  # one failing part never skips the others
        for exc in (r for r in results if isinstance(r, BaseException)):
            log.error("health check part failed: %r", exc, exc_info=exc)
        if not self.colocated and self.owns_pairs and (self._repair is None or self._repair.done()):
            self._repair = asyncio.get_running_loop().create_task(self._pair_missing())

    async def _check(self, worker: WorkerRef) -> None:
        try:
            report = await asyncio.wait_for(worker.client.health(), self.cfg.health_timeout_s)
            healthy = report.alive
            worker.note(report)
        except Exception:  # dead actor, timeout: both mean do not route here
            healthy = False
        else:
            if self.owns_pairs:
                await self._unpair_broken(worker, report.broken_pairs)
            else:  # the owner's router pairs; this one routes over the pairs the worker reports
                worker.peers = set(report.peers)
        if healthy != worker.healthy:
            log.warning("worker %s is now %s", worker.worker_id, "healthy" if healthy else "UNHEALTHY")
        worker.healthy = healthy

    def status(self) -> dict:
        return {w.worker_id: {"role": w.role, "healthy": w.healthy, "inflight": w.inflight,
                              "queued_tokens": w.queued_tokens} for w in self.workers.values()}
