"""An in-memory prefix index with the router's IndexView interface, fed by the simulated
workers' real cache events (engine.cache_events).

`MemoryIndex` holds what the Redis layout of router/index/query.py holds (block hash ->
worker id -> tier mask) and answers the same longest-prefix query; leases do not expire in
a simulation, so every registered worker is live. `MemoryIndexView` is what the Router and
its Picker call (bind, hashes, hits, refresh, recent, block_size, status), on the virtual
clock.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from engine.block_hash import chain_hashes, salted_root
from engine.cache_events import CacheEvent
from router.index.keys import TIER_BITS
from router.index.query import PrefixHit
from router.index.view import RecentRoutes


class MemoryIndex:
    def __init__(self) -> None:
        self.blocks: dict[bytes, dict[str, int]] = {}  # block hash -> worker id -> tier mask
        self.workers: set[str] = set()

    def apply(self, worker_id: str, events: list[CacheEvent]) -> None:
        """A worker's published batch, in its order (stored before removed on a tier move)."""
        self.workers.add(worker_id)
        for e in events:
            bit = TIER_BITS[e.tier]
            for h in e.hashes:
                if e.kind == "stored":
                    holders = self.blocks.setdefault(h, {})
                    holders[worker_id] = holders.get(worker_id, 0) | bit
                    continue
                holders = self.blocks.get(h)
                if holders is None:
                    continue
                mask = holders.get(worker_id, 0) & ~bit
                if mask:
                    holders[worker_id] = mask
                else:
                    holders.pop(worker_id, None)
                    if not holders:
                        del self.blocks[h]

    def query(self, hashes: Sequence[bytes], worker_ids: Sequence[str]) -> dict[str, PrefixHit]:
        """Each worker's leading held blocks of `hashes`, by the fastest tier holding each
        (the Lua script's answer, router/index/query.py)."""
        counts = {w: [0, 0, 0, 0] for w in worker_ids}
        active = list(worker_ids)
        for h in hashes:
            if not active:
                break
            holders = self.blocks.get(h, {})
            still = []
            for w in active:
                mask = holders.get(w, 0)
                if mask:
                    c = counts[w]
                    c[0] += 1
                    c[1 if mask & 1 else 2 if mask & 2 else 3] += 1
                    still.append(w)
            active = still
        return {w: PrefixHit(*c) for w, c in counts.items()}


class MemoryIndexView:
    def __init__(self, index: MemoryIndex, recent_s: float = 5.0, clock: Callable[[], float] | None = None):
        self.index = index
        self.recent = RecentRoutes(recent_s, clock or (lambda: asyncio.get_running_loop().time()))
        self.model_id: str | None = None
        self.block_size = 0
        self.available = True
        self.queries = 0

    def bind(self, model_id: str, block_size: int) -> None:
        if self.model_id is not None and (model_id, block_size) != (self.model_id, self.block_size):
            raise ValueError(f"worker runs {model_id!r} with {block_size}-token blocks; others run "
                             f"{self.model_id!r} with {self.block_size}")
        self.model_id, self.block_size = model_id, block_size

    def hashes(self, prompt: Sequence[int], cache_salt: str | None) -> list[bytes]:
        usable = max(0, len(prompt) - 1) // self.block_size * self.block_size  # the last token is always computed
        return chain_hashes(prompt[:usable], self.block_size, self.model_id, parent=salted_root(cache_salt))

    async def hits(self, prompt: Sequence[int], cache_salt: str | None, worker_ids: Sequence[str]
                   ) -> tuple[list[bytes], dict[str, PrefixHit]] | None:
        """As IndexView.hits: the prompt's hashes and each worker's leading cached blocks,
        with blocks routed there moments ago counted as held on device."""
        if self.model_id is None:
            return None
        hashes = self.hashes(prompt, cache_salt)
        hits = self.index.query(hashes, worker_ids)
        self.queries += 1
        self.recent.raise_hits(hashes, hits, worker_ids)
        return hashes, hits

    async def refresh(self) -> None:
        return None

    def status(self) -> dict:
        return {"available": True, "error": None, "live_workers": sorted(self.index.workers),
                "model_id": self.model_id, "queries": self.queries, "blocks": len(self.index.blocks)}
