"""What a prefill and a decode worker share: an engine in its role on its loop thread, the
cache-event publisher handed in at launch, the health report, stats and shutdown; and the
async base both Ray actors delegate through.

No Ray here, so the plain workers run in tests without it: the actors in prefill_worker/ and decode_worker/
subclass `WorkerActor` under `@ray.remote`, which keeps its methods.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.messages import WorkerHealth
from worker.faults import FaultInjector


class Publisher(Protocol):
    """A worker's lease and cache events in the prefix index (router/index/publisher.py)."""

    def status(self) -> dict: ...
    def stop(self) -> None: ...


# (worker id, role, the worker's loop) -> its started publisher. cluster/ hands one in when the
# cluster has an index; the engine config then records cache events where they are published.
PublisherFactory = Callable[[str, str, EngineLoop], Publisher]


class EngineWorker:
    """Owns the engine, its loop thread and the publisher; subclasses add their transfers."""

    def __init__(self, worker_id: str, engine_cfg: EngineConfig, publisher: PublisherFactory | None = None):
        self.worker_id = worker_id
        self.role = engine_cfg.role.value
        self.engine = LLMEngine(engine_cfg)
        self.loop = EngineLoop(self.engine, name=f"{worker_id}-engine").start()
        self.publisher = publisher(worker_id, self.role, self.loop) if publisher is not None else None

    def broken_pairs(self) -> list[str]:
        """Peers whose KV link failed (the router rebuilds those pairs)."""
        return []

    def peers(self) -> list[str]:
        """Counterparts with a working KV pair (none for a worker that transfers nothing)."""
        return []

    def health(self) -> WorkerHealth:
        """Liveness, what it hashes with, its load. (Unlocked reads from the engine thread: a hint.)"""
        e, loop = self.engine, self.loop.health()
        extra = e.runner.health()  # a parallel runner: its sizes, and not alive when its group is down
        return WorkerHealth(
            worker_id=self.worker_id, role=self.role, alive=extra.get("alive", loop["alive"]),
            error=extra.get("error", loop["error"]), model_id=e.model_id, block_size=e.block_size,
            free_blocks=e.pool.num_free, running=len(e.scheduler.running), broken_pairs=tuple(self.broken_pairs()),
            peers=tuple(self.peers()),
            index=self.publisher.status() if self.publisher is not None else None,
            tp_size=extra.get("tp_size", 1), ep_size=extra.get("ep_size", 1))

    def stats(self) -> dict:
        return self.loop.call(lambda e: e.stats()).result()

    def close_engine(self) -> None:
        if self.publisher is not None:
            self.publisher.stop()  # ends the lease first: no new requests are routed here
        self.loop.stop()
        self.engine.close()  # after the loop: finishes pending HiCache disk writes


class WorkerActor:
    """The methods both actors delegate the same way; `self.worker` is set by the subclass."""

    worker: EngineWorker
    faults: FaultInjector

    def _serve(self, worker: EngineWorker) -> None:
        self.worker = worker
        self.faults = FaultInjector.from_env(worker.loop)  # chaos tests only

    async def health(self) -> WorkerHealth:
        return self.worker.health()

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.worker.stats)

    async def inject_fault(self, kind: str) -> None:
        """Chaos tests only: refused unless the worker started with BRIGADE_FAULT_INJECTION=1 (worker/faults.py)."""
        self.faults.inject(kind)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.worker.close)
