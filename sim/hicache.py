"""HiCache's host tier (L2) in a simulated worker: a capacity and a bandwidth, no bytes.

Write-back, like engine.hicache's write_back policy: a block the device pool evicts is kept in
host memory (least recently used beyond `capacity_blocks` goes), and a request whose device
hit is continued by host blocks loads them back instead of computing them. The load costs
blocks * block_bytes over the host link, added to the step that uses them. The tier publishes
the same cache events (`stored` / `removed` in "host") as the real one, so the router's
kv_aware rule sees host hits at their host_load_cost. It plugs into the engine's real
Scheduler (its PrefixLoader hook) and RadixCache (its TierListener hook).
"""
from __future__ import annotations

from collections import OrderedDict

from engine.block_pool import BlockPool
from engine.radix_cache import RadixCache
from engine.sequence import Sequence
from sim.hardware import LinkProfile


class SimHostTier:
    def __init__(self, cache: RadixCache, pool: BlockPool, capacity_blocks: int, block_bytes: int,
                 link: LinkProfile):
        self.cache, self.pool, self.capacity, self.block_bytes, self.link = (
            cache, pool, capacity_blocks, block_bytes, link)
        self.blocks: OrderedDict[bytes, None] = OrderedDict()  # hash -> (nothing), least recent first
        self.pending_s = 0.0  # load-back time the next step pays
        self.stats = {"stored": 0, "loaded": 0, "dropped": 0}
        cache.listener = self

    # -- TierListener (the device tier evicts) ----------------------------------------
    def on_insert(self, h: bytes, block_id: int) -> None:
        return None  # write-back: nothing to copy until the device tier lets it go

    def on_evict(self, blocks: list[tuple[bytes, int]]) -> None:
        stored = []
        for h, _ in blocks:
            if h not in self.blocks:
                stored.append(h)
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        self.stats["stored"] += len(stored)
        if stored:
            self.cache.events.record("stored", "host", tuple(stored))
        dropped = []
        while len(self.blocks) > self.capacity:
            dropped.append(self.blocks.popitem(last=False)[0])
        self.stats["dropped"] += len(dropped)
        if dropped:
            self.cache.events.record("removed", "host", tuple(dropped))

    # -- PrefixLoader (the scheduler extends a device hit) ----------------------------
    def load_back(self, seq: Sequence, hashes: list[bytes], num_device: int) -> tuple[list[int], dict[str, int]]:
        found = []
        limit = self.pool.num_free
        for h in hashes[num_device:]:
            if len(found) >= limit or h not in self.blocks:
                break
            found.append(h)
        by_tier = {"device": num_device} if num_device else {}
        if not found:
            return [], by_tier
        blocks = self.pool.allocate(len(found))
        parent = hashes[num_device - 1] if num_device else self.cache.root.hash
        for h, b in zip(found, blocks):
            self.cache.insert(parent, h, b)
            self.blocks.move_to_end(h)
            parent = h
        self.pending_s += self.link.transfer_s(len(found) * self.block_bytes)
        self.stats["loaded"] += len(found)
        by_tier["host"] = len(found)
        return blocks, by_tier

    def take_pending_s(self) -> float:
        t, self.pending_s = self.pending_s, 0.0
        return t
