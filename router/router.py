"""Admission and dispatch: the routing policy picks prefill and decode workers, token streams back.

Disaggregated: reserve KV blocks on a decode worker, prefill on a prefill worker (first
token), then the decode worker pulls the KV and streams from the first token on.
Colocated: one mixed worker runs the whole request. Workers are Ray actor handles. The
policy (router/policy.py) asks the prefix index (router/index_view.py) where the prompt's
prefix is cached; without Redis it routes by load alone. A request whose worker dies
continues on another from the tokens already sent (router/migration.py), at most
RouterConfig.max_migrations times.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from engine.outputs import Usage
from router import policy
from router.config import RouterConfig
from router.index_view import IndexView
from router.migration import continuation
from router.policy import RoundRobin
from router.types import Chunk, GenerateRequest, NoWorker, Overloaded, StreamBroken, Timing

log = logging.getLogger(__name__)


@dataclass(eq=False)
class WorkerRef:
    worker_id: str
    role: str  # "prefill" | "decode" | "mixed"
    handle: object  # ray.actor.ActorHandle
    inflight: int = 0
    queued_tokens: int = 0  # prompt tokens routed here whose prefill has not finished (kv_aware's queue)
    routed: int = 0  # requests routed here so far (spreads new conversations over idle workers)
    free_blocks: int = 0  # from the last health check
    running: int = 0  # the engine's running batch, from the last health check
    healthy: bool = True
    peers: set[str] = field(default_factory=set)  # connected counterpart ids


class _WorkerLost(Exception):
    """A worker died under a request (or its stream ended without a last chunk): migrate it."""

    def __init__(self, worker_id: str):
        super().__init__(worker_id)
        self.worker_id = worker_id


def _never(exc: BaseException) -> bool:
    return False


class Router:
    def __init__(self, cfg: RouterConfig, colocated: bool, index: IndexView | None = None,
                 worker_died: Callable[[BaseException], bool] = _never):
        """`worker_died`: whether an exception from a worker call means the worker is gone (the
        Ray actor shim passes Ray's actor-death errors; the router itself knows no Ray)."""
        self.cfg = cfg
        self.worker_died = worker_died
        self.colocated = colocated
        self.index = index
        self._round_robin = RoundRobin()
        self._rng = random.Random()
        # kv_aware decisions: by the index, and how many went elsewhere than the longest hit (load won)
        self.kv_picks = {"by_index": 0, "load_over_hit": 0}
        self.workers: dict[str, WorkerRef] = {}
        self.waiting = 0
        self.waiting_tokens = 0  # prompt tokens of the waiting requests
        self.running = 0
        self.peak = {"waiting": 0, "waiting_tokens": 0, "running": 0}  # high-water marks since start
        self._slots = asyncio.Semaphore(cfg.max_running)
        # request id -> (prefill, decode, the id the workers know it by: a migrated request's differs)
        self._active: dict[str, tuple[WorkerRef | None, WorkerRef | None, str]] = {}
        self._aborted: set[str] = set()  # active requests abort() was called for
        self._health_task: asyncio.Task | None = None
        self._repair: asyncio.Task | None = None  # _pair_missing, one at a time
        self._pairing = asyncio.Lock()

    # -- membership ---------------------------------------------------------------
    async def add_worker(self, role: str, worker_id: str, handle) -> None:
        """Register a worker; in disaggregated mode connect it to every counterpart first."""
        ref = WorkerRef(worker_id, role, handle)
        report = await handle.health.remote()
        self._note(ref, report)
        if self.index is not None and role in ("prefill", "mixed"):
            self.index.bind(report["model_id"], report["block_size"])
        if not self.colocated:
            other = "decode" if role == "prefill" else "prefill"
            # Healthy ones only: a dead counterpart would hold the pairing until its timeout.
            async with self._pairing:  # one accept at a time per transfer server
                for w in [w for w in self.workers.values() if w.role == other and w.healthy]:
                    await (self._pair(ref, w) if role == "prefill" else self._pair(w, ref))
        self.workers[worker_id] = ref
        if self.index is not None:
            await self.index.refresh()  # its lease, so the first request already sees its cache
        if self._health_task is None:
            self._health_task = asyncio.get_running_loop().create_task(self._health_loop())

    async def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker (dead, or being replaced): no request is routed to it from now on,
        and its counterparts close their pairs with it. False if it was not registered."""
        ref = self.workers.pop(worker_id, None)
        if ref is None:
            return False
        peers = [w for w in self.workers.values() if worker_id in w.peers]
        for w in peers:
            w.peers.discard(worker_id)
        await asyncio.gather(*(asyncio.wait_for(w.handle.disconnect.remote(worker_id), self.cfg.health_timeout_s)
                               for w in peers), return_exceptions=True)
        return True

    async def _pair(self, prefill: WorkerRef, decode: WorkerRef) -> None:
        address = await decode.handle.address.remote()
        accepted, _ = await asyncio.gather(decode.handle.accept.remote(prefill.worker_id),
                                           prefill.handle.connect.remote(decode.worker_id, address))
        if accepted != prefill.worker_id:
            raise RuntimeError(f"{decode.worker_id} accepted {accepted!r} while pairing {prefill.worker_id!r}")
        prefill.peers.add(decode.worker_id)
        decode.peers.add(prefill.worker_id)

    def live(self, role: str) -> list[WorkerRef]:
        return [w for w in self.workers.values() if w.role == role and w.healthy]

    def _pool(self, role: str, exclude: set[str] = frozenset(), peer_of: WorkerRef | None = None,
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

    async def _pick_prefill(self, role: str, req: GenerateRequest,
                            exclude: set[str] = frozenset()) -> tuple[WorkerRef, int]:
        """The worker that computes the prompt, and the uncached tokens it is charged with."""
        needs_peer = role == "prefill" and req.params.max_tokens > 1
        pool, n = self._pool(role, exclude, needs_peer=needs_peer), len(req.prompt_token_ids)
        answer = None
        if self.cfg.policy == "kv_aware" and self.index is not None:
            answer = await self.index.hits(req.prompt_token_ids, req.cache_salt, [w.worker_id for w in pool])
            pool = self._pool(role, exclude, needs_peer=needs_peer)  # health may have changed while we asked
        if answer is not None:
            hashes, hits = answer
            w = policy.pick_kv_aware(pool, hits, n, self.index.block_size, self.cfg)
            self.kv_picks["by_index"] += 1
            best = max((hits.get(v.worker_id, policy.PrefixHit()).blocks for v in pool), default=0)
            self.kv_picks["load_over_hit"] += hits.get(w.worker_id, policy.PrefixHit()).blocks < best
            self.index.recent.note(hashes, w.worker_id)
            w.routed += 1
            return w, n - policy.cached_tokens(hits.get(w.worker_id, policy.PrefixHit()), n, self.index.block_size)
        w = self._pick_by_load(role, pool)
        w.routed += 1
        return w, n

    def _pick_decode(self, exclude: set[str], peer_of: WorkerRef) -> WorkerRef:
        pool = self._pool("decode", exclude, peer_of)
        if self.cfg.policy == "kv_aware":  # the batch it runs and the room it has left
            return min(pool, key=lambda w: (w.inflight + w.running, -w.free_blocks, w.worker_id))
        return self._pick_by_load("decode", pool)

    def _pick_by_load(self, role: str, pool: list[WorkerRef]) -> WorkerRef:
        if self.cfg.policy == "round_robin":
            return self._round_robin.pick(role, pool)
        if self.cfg.policy == "random":
            return policy.pick_random(pool, self._rng)
        return policy.pick_least_loaded(pool)

    # -- requests -----------------------------------------------------------------
    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        n = len(req.prompt_token_ids)
        if self._slots.locked() and (self.waiting >= self.cfg.max_waiting
                                     or self.waiting_tokens + n > self.cfg.max_waiting_tokens):
            raise Overloaded(f"overloaded: {self.waiting} requests ({self.waiting_tokens} prompt tokens) waiting; "
                             "retry later")
        arrived = time.monotonic()
        self.waiting += 1
        self.waiting_tokens += n
        self._note_peak()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.waiting_tokens -= n
        self.running += 1
        self._note_peak()
        timing = Timing(queue_s=time.monotonic() - arrived)
        try:
            source = self._migrating(req, timing)
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

    def _note_peak(self) -> None:
        for name in self.peak:
            self.peak[name] = max(self.peak[name], getattr(self, name))

    async def _migrating(self, req: GenerateRequest, timing: Timing):
        """The request's chunks; when a worker dies under it, the rest comes from a continuation
        (prompt + the tokens sent) on other workers, so the client sees every token once."""
        sent: list[int] = []
        chars = 0  # characters of text sent (a continuation resumes its text after them)
        avoid: set[str] = set()  # workers that failed this request
        attempt = req
        while True:
            run = (self._colocated(attempt, req.request_id, avoid) if self.colocated
                   else self._disaggregated(attempt, req.request_id, timing, avoid))
            try:
                async for chunk, prefill, decode in run:
                    chunk.request_id = req.request_id
                    sent += chunk.token_ids
                    chars += len(chunk.text)
                    if chunk.finished and chunk.usage is not None and attempt is not req:
                        chunk.usage = dataclasses.replace(
                            chunk.usage, prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(sent),
                            cached_tokens=min(chunk.usage.cached_tokens, len(req.prompt_token_ids)))
                    yield chunk, prefill, decode
                return
            except _WorkerLost as lost:
                avoid.add(lost.worker_id)
                if timing.migrations >= self.cfg.max_migrations:
                    raise StreamBroken(len(sent), f"worker {lost.worker_id} died after {len(sent)} tokens were "
                                                  f"sent and the request already moved {timing.migrations} times "
                                                  f"(max_migrations); retry") from None
                timing.migrations += 1
                log.warning("worker %s died under %s after %d tokens; migrating (%d of at most %d)",
                            lost.worker_id, req.request_id, len(sent), timing.migrations, self.cfg.max_migrations)
            except NoWorker as exc:
                if attempt is req or isinstance(exc, StreamBroken):
                    raise
                raise StreamBroken(len(sent), f"{exc} ({len(sent)} tokens were sent)") from None
            if len(sent) >= req.params.max_tokens:  # everything was sent but the last chunk
                usage = Usage(len(req.prompt_token_ids), len(sent), 0)
                yield Chunk(req.request_id, [], "", True, "length", usage), None, None
                return
            if req.request_id in self._aborted:
                yield _abort_chunk(req.request_id), None, None
                return
            attempt = continuation(req, sent, chars, timing.migrations) if sent else dataclasses.replace(
                req, request_id=f"{req.request_id}#m{timing.migrations}")

    async def _colocated(self, req: GenerateRequest, key: str, avoid: set[str]):
        worker, queued = await self._pick_prefill("mixed", req, avoid)
        self._active[key] = (None, worker, req.request_id)
        worker.inflight += 1
        worker.queued_tokens += queued
        try:
            async for chunk in self._from_worker(worker, worker.handle.generate_local.remote(req), key):
                if queued and (chunk.token_ids or chunk.finished):  # the prompt is computed
                    worker.queued_tokens -= queued
                    queued = 0
                yield chunk, None, worker
        finally:
            worker.inflight -= 1
            worker.queued_tokens -= queued

    async def _disaggregated(self, req: GenerateRequest, key: str, timing: Timing, avoid: set[str]):
        """One attempt at `req`, known to abort() as `key` (a migrated request's continuation
        has its own id at the workers)."""
        rid = req.request_id
        prefill, queued = await self._pick_prefill("prefill", req, avoid)
        prefill.inflight += 1  # counted from the pick on, so concurrent requests spread out
        prefill.queued_tokens += queued
        self._active[key] = (prefill, None, rid)
        prefilling, decode = True, None
        try:
            # max_tokens 1: the prefill worker's first token is the whole answer, so no decode
            # worker is needed (nor a reservation that would hold its blocks through the prefill).
            if req.params.max_tokens > 1:
                decode = await self._reserve(req, prefill, avoid)
            self._active[key] = (prefill, decode, rid)
            start = time.monotonic()
            try:
                first = await prefill.handle.prefill.remote(req)
            except BaseException as exc:
                if decode is not None:
                    await decode.handle.abort.remote(rid)  # frees the reservation
                if key not in self._aborted and isinstance(exc, Exception) and self.worker_died(exc):
                    raise _WorkerLost(prefill.worker_id) from exc  # retried elsewhere
                if not (key in self._aborted and isinstance(exc, Exception)):
                    raise
                yield _abort_chunk(rid), prefill, decode  # abort() ended the prefill
                return
            timing.prefill_s = time.monotonic() - start
            if key in self._aborted:  # while reserving, or before the prefill worker had the request
                await asyncio.gather(*(w.handle.abort.remote(rid) for w in (prefill, decode) if w is not None))
                yield _abort_chunk(rid), prefill, decode
                return
            if first.finished:  # the first token already ended it: nothing to transfer
                if decode is not None:
                    await decode.handle.abort.remote(rid)
                yield Chunk(rid, [first.first_token_id], first.text, True, first.finish_reason,
                            first.usage, [first.first_logprobs] if first.first_logprobs else None), prefill, None
                return
            prefill.inflight -= 1
            prefill.queued_tokens -= queued
            prefilling = False
            stream = decode.handle.generate.remote(req, first, prefill.worker_id, prefill.handle)
            async for chunk in self._from_worker(decode, stream, key):
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

    async def _from_worker(self, worker: WorkerRef, stream, key: str):
        """The chunks of `worker`'s stream (Ray refs). Its death under the request, or a stream
        that ends without a last chunk, raises _WorkerLost (the request migrates); any other
        error, or any error once the request is aborted, is the request's own and passes on."""
        finished = False
        try:
            async for ref in stream:
                chunk = await ref
                finished = chunk.finished
                yield chunk
        except Exception as exc:
            if key in self._aborted or not self.worker_died(exc):
                raise
            raise _WorkerLost(worker.worker_id) from exc
        if not finished:
            raise _WorkerLost(worker.worker_id)

    async def _reserve(self, req: GenerateRequest, prefill: WorkerRef, avoid: set[str] = frozenset()):
        """A decode worker connected to `prefill` (and not in `avoid`) with blocks for the
        prompt's KV; its inflight count already includes this request."""
        tried: set[str] = set(avoid)
        while True:
            decode = self._pick_decode(tried, prefill)
            decode.inflight += 1  # before the await, as for the prefill pick
            try:
                if await decode.handle.reserve.remote(req.request_id, len(req.prompt_token_ids)):
                    return decode
            except asyncio.CancelledError:
                decode.inflight -= 1
                # The reservation may have been made after all: free it now rather than at hold_timeout_s.
                decode.handle.abort.remote(req.request_id)
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
        prefill, decode, worker_rid = self._active[request_id]
        calls = [w.handle.abort.remote(worker_rid) for w in (prefill, decode) if w is not None]
        await asyncio.gather(*calls, return_exceptions=True)
        return bool(calls)

    # -- health ---------------------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            checks = [self._check(w) for w in list(self.workers.values())]
            await asyncio.gather(*checks, *([self.index.refresh()] if self.index is not None else []))
            if not self.colocated and (self._repair is None or self._repair.done()):
                self._repair = asyncio.get_running_loop().create_task(self._pair_missing())

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

    async def _check(self, worker: WorkerRef) -> None:
        try:
            report = await asyncio.wait_for(worker.handle.health.remote(), self.cfg.health_timeout_s)
            healthy = bool(report.get("alive"))
            self._note(worker, report)
        except Exception:  # dead actor, timeout: both mean do not route here
            healthy = False
        else:
            await self._unpair_broken(worker, report.get("broken_pairs", ()))
        if healthy != worker.healthy:
            log.warning("worker %s is now %s", worker.worker_id, "healthy" if healthy else "UNHEALTHY")
        worker.healthy = healthy

    async def _unpair_broken(self, worker: WorkerRef, broken) -> None:
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
            await asyncio.gather(*(asyncio.wait_for(w.handle.disconnect.remote(other), self.cfg.health_timeout_s)
                                   for w, other in ends), return_exceptions=True)

    @staticmethod
    def _note(worker: WorkerRef, report: dict) -> None:
        worker.free_blocks = report.get("free_blocks", worker.free_blocks)
        worker.running = report.get("running", worker.running)

    def status(self) -> dict:
        return {"waiting": self.waiting, "running": self.running, "colocated": self.colocated,
                "waiting_tokens": self.waiting_tokens, "peak": dict(self.peak),
                "policy": self.cfg.policy, "kv_picks": dict(self.kv_picks),
                "index": self.index.status() if self.index is not None else {"available": False, "error": "no Redis"},
                "workers": {w.worker_id: {"role": w.role, "healthy": w.healthy, "inflight": w.inflight,
                                          "queued_tokens": w.queued_tokens} for w in self.workers.values()}}


def _abort_chunk(request_id: str) -> Chunk:
    return Chunk(request_id, [], "", True, "abort")
