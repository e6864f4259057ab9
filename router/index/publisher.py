"""A worker's side of the prefix index: its lease and its cache entries in Redis.

One daemon thread per worker. Every `publish_interval_s` it takes the engine's cache events,
folds them into a local mirror (block hash -> tier mask) and marks the touched blocks dirty;
then one MULTI/EXEC writes the current state of the dirty blocks (HSET the worker's field,
or HDEL it once no tier holds the block) together with the worker's sequence number. Since
it writes states, not deltas, a failed batch is simply retried and order cannot go wrong.

Gaps: the sequence number comes back from Redis with every batch; if it is not the one
after ours (Redis restarted or was flushed, or someone reset it), or a resync flag was set
(PrefixIndex.request_resync), the whole mirror is re-published. A lease found expired (a
Redis restart, a long pause) is re-registered under a new epoch, which also re-publishes
everything, since entries of the old epoch no longer count. Redis errors are logged once
per outage; the worker serves on meanwhile.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import redis

from engine.cache_events import CacheEvent
from router.config import IndexConfig, IndexLink
from router.index.keys import TIER_BITS, IndexKeys, encode
from router.index.registry import WorkerRegistry, connect

log = logging.getLogger(__name__)
MAX_BATCH = 2000  # blocks per transaction: a full resync goes out over several rounds


class IndexPublisher:
    def __init__(self, cfg: IndexConfig, redis_url_or_client: str | redis.Redis, worker_id: str, role: str,
                 model_id: str, take_events: Callable[[], list[CacheEvent]], info: dict[str, Any] | None = None):
        r = redis_url_or_client
        # A refused password fails the worker's start; an unreachable Redis does not (it may come back).
        self.redis = connect(r, must_answer=False) if isinstance(r, str) else r
        self.cfg, self.worker_id, self.role, self.take_events = cfg, worker_id, role, take_events
        self.info = {"model_id": model_id, **(info or {})}
        self.registry = WorkerRegistry(self.redis, prefix=cfg.key_prefix, ttl_s=cfg.lease_ttl_s)
        self.keys = IndexKeys(cfg.key_prefix, model_id)
        self.mirror: dict[bytes, int] = {}  # what this worker holds: block hash -> tier mask
        self.dirty: set[bytes] = set()  # blocks whose state Redis may not have yet
        self.epoch: int | None = None
        self.seq = 0
        self.resyncs = 0  # full re-publications (after a gap, a flag, a new epoch)
        self.connected = True
        self._next_beat = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"index-{worker_id}", daemon=True)

    def start(self) -> IndexPublisher:
        self._step_logged()  # registers now: a worker is routable by its cache only once its lease exists
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.publish_interval_s):
            try:
                self._step_logged()
            except Exception:  # the engine died: the lease then expires on its own
                log.exception("%s: index publisher stopped", self.worker_id)
                return

    def _step_logged(self) -> None:
        try:
            self.step()
        except redis.RedisError as exc:
            if self.connected:
                log.warning("%s: Redis unreachable (%s); the index will be re-published when it returns",
                            self.worker_id, exc)
            self.connected = False

    def step(self) -> None:
        """One round: take events, keep the lease, write a batch. Raises redis errors."""
        self._apply(self.take_events())
        now = time.monotonic()
        if self.epoch is None:
            self._register()
        elif now >= self._next_beat:
            if not self.registry.heartbeat(self.worker_id, self.epoch):
                log.warning("%s: lease (epoch %d) lost; registering again", self.worker_id, self.epoch)
                self._register()
            self._next_beat = now + self.cfg.lease_ttl_s / 3
        self._flush()
        if not self.connected:
            log.warning("%s: Redis is back; index re-published under epoch %d", self.worker_id, self.epoch)
            self.connected = True

    def _apply(self, events: list[CacheEvent]) -> None:
        for e in events:
            bit = TIER_BITS[e.tier]
            for h in e.hashes:
                mask = self.mirror.get(h, 0)
                mask = mask | bit if e.kind == "stored" else mask & ~bit
                if mask:
                    self.mirror[h] = mask
                else:
                    self.mirror.pop(h, None)
                self.dirty.add(h)

    def _register(self) -> None:
        self.epoch = self.registry.register(self.worker_id, self.role, self.info)
        self.redis.delete(self.keys.pub(self.worker_id))
        self.seq = 0
        self._next_beat = time.monotonic() + self.cfg.lease_ttl_s / 3
        self._resync()

    def _resync(self) -> None:
        self.resyncs += 1
        self.dirty |= set(self.mirror)

    def _flush(self) -> None:
        batch = [self.dirty.pop() for _ in range(min(len(self.dirty), MAX_BATCH))]
        try:
            with self.redis.pipeline(transaction=True) as p:
                pub = self.keys.pub(self.worker_id)
                p.hincrby(pub, "seq", 1).hset(pub, "epoch", self.epoch).delete(self.keys.resync(self.worker_id))
                for h in batch:
                    mask = self.mirror.get(h, 0)
                    if mask:
                        p.hset(self.keys.block(h), self.worker_id, encode(self.epoch, mask))
                    else:
                        p.hdel(self.keys.block(h), self.worker_id)
                seq, _, asked = p.execute()[:3]
        except BaseException:
            self.dirty.update(batch)
            raise
        gap, expected, self.seq = seq != self.seq + 1, self.seq + 1, seq
        if gap or asked:
            log.warning("%s: %s; re-publishing the whole cache", self.worker_id,
                        f"sequence gap (expected {expected}, Redis has {seq})" if gap else "resync asked")
            if gap and not self.registry.heartbeat(self.worker_id, self.epoch):
                self._register()  # Redis lost the lease with everything else
            else:
                self._resync()

    def status(self) -> dict:
        return {"epoch": self.epoch, "seq": self.seq, "blocks": len(self.mirror), "pending": len(self.dirty),
                "resyncs": self.resyncs, "connected": self.connected}

    def stop(self) -> None:
        """Stop publishing and end the lease now (its entries stop counting at once)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.epoch is not None:
            try:
                self.registry.deregister(self.worker_id, self.epoch)
            except redis.RedisError as exc:  # it expires on its own
                log.warning("%s: could not end the lease: %s", self.worker_id, exc)
        self.redis.close()


def worker_publisher(link: IndexLink, worker_id: str, role: str, loop) -> IndexPublisher:
    """Start a worker's lease, and its cache events' publication for prefill and mixed workers
    (a decode worker's cache serves no routing decision). The worker.base
    PublisherFactory cluster/ hands each worker at launch, as `partial(worker_publisher, link)`;
    `loop` is the worker's EngineLoop, built with cache.record_events on when publishing."""
    def take() -> list[CacheEvent]:
        # No timeout that would drop the call: its events would be lost when it ran later. A
        # long step only delays the batch (and the heartbeat: a stuck engine loses its lease).
        taken = loop.call(lambda e: e.take_cache_events())
        while True:
            try:
                return taken.result(timeout=1.0)
            except FutureTimeout:
                if not loop.alive:
                    raise RuntimeError("the engine loop stopped") from None

    engine = loop.engine
    return IndexPublisher(link.index, link.redis_url, worker_id, role, engine.model_id,
                          take if publishes_events(role) else list, info={"block_size": engine.block_size}).start()


def publishes_events(role: str) -> bool:
    """Whether a worker of `role` publishes its cache (its engine must then record events)."""
    return role in ("prefill", "mixed")
