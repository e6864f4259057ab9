"""HiCache's host (L2) and disk (L3) tiers in a simulated worker: capacities and bandwidths,
no bytes.

As engine.hicache's write_back policy: a block the device pool evicts is kept in host memory
(least recently used beyond `capacity_blocks` goes); a block host memory lets go is written to
disk when there is a disk tier (least recently used beyond `disk_blocks` goes). A request
whose device hit is continued by host or disk blocks loads them back instead of computing
them: host blocks over the host link, disk blocks over the disk link (each tier's blocks *
block_bytes / bandwidth + its latency), added to the step that uses them; a block read from
disk is kept in host memory again (it is hot). The tiers publish the same cache events
(`stored` / `removed` in "host" and "disk") as the real ones, so the router's kv_aware rule
sees slow-tier hits at their host_load_cost / disk_load_cost. They plug into the engine's
real Scheduler (its PrefixLoader hook) and RadixCache (its TierListener hook).
"""
from __future__ import annotations

from collections import OrderedDict

from engine.block_pool import BlockPool
from engine.radix_cache import RadixCache
from engine.sequence import Sequence
from sim.hardware import LinkProfile


class SimHostTier:
    def __init__(self, cache: RadixCache, pool: BlockPool, capacity_blocks: int, block_bytes: int,
                 link: LinkProfile, disk_blocks: int = 0, disk_link: LinkProfile | None = None):
        if disk_blocks and disk_link is None:
            raise ValueError("a disk tier needs its link (bandwidth and latency)")
        self.cache, self.pool, self.capacity, self.block_bytes, self.link = (
            cache, pool, capacity_blocks, block_bytes, link)
        self.disk_capacity, self.disk_link = disk_blocks, disk_link
        self.blocks: OrderedDict[bytes, None] = OrderedDict()  # host: hash -> (nothing), least recent first
        self.disk: OrderedDict[bytes, None] = OrderedDict()
        self.pending_s = 0.0  # load-back time the next step pays
        self.stats = {"stored": 0, "loaded": 0, "dropped": 0, "disk_stored": 0, "disk_loaded": 0, "disk_dropped": 0}
        cache.listener = self

    # -- TierListener (the device tier evicts) ----------------------------------------
    def on_insert(self, h: bytes, block_id: int) -> None:
        return None  # write-back: nothing to copy until the device tier lets it go

    def on_evict(self, blocks: list[tuple[bytes, int]]) -> None:
        self._to_host([h for h, _ in blocks])

    def _to_host(self, hashes: list[bytes]) -> None:
        stored = [h for h in hashes if h not in self.blocks]
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        self.stats["stored"] += len(stored)
        if stored:
            self.cache.events.record("stored", "host", tuple(stored))
        dropped = []
        while len(self.blocks) > self.capacity:
            dropped.append(self.blocks.popitem(last=False)[0])
        if dropped:
            self._to_disk(dropped)  # stored in the new tier before removed from the old
            self.stats["dropped"] += len(dropped)
            self.cache.events.record("removed", "host", tuple(dropped))

    def _to_disk(self, hashes: list[bytes]) -> None:
        if not self.disk_capacity:
            return
        stored = [h for h in hashes if h not in self.disk]
        for h in hashes:
            self.disk[h] = None
            self.disk.move_to_end(h)
        self.stats["disk_stored"] += len(stored)
        if stored:
            self.cache.events.record("stored", "disk", tuple(stored))
        dropped = []
        while len(self.disk) > self.disk_capacity:
            dropped.append(self.disk.popitem(last=False)[0])
        self.stats["disk_dropped"] += len(dropped)
        if dropped:
            self.cache.events.record("removed", "disk", tuple(dropped))

    # -- PrefixLoader (the scheduler extends a device hit) ----------------------------
    def load_back(self, seq: Sequence, hashes: list[bytes], num_device: int) -> tuple[list[int], dict[str, int]]:
        found: list[tuple[bytes, str]] = []
        limit = self.pool.num_free
        for h in hashes[num_device:]:
            tier = "host" if h in self.blocks else "disk" if h in self.disk else None
            if len(found) >= limit or tier is None:
                break
            found.append((h, tier))
        by_tier = {"device": num_device} if num_device else {}
        if not found:
            return [], by_tier
        blocks = self.pool.allocate(len(found))
        parent = hashes[num_device - 1] if num_device else self.cache.root.hash
        for (h, tier), b in zip(found, blocks):
            self.cache.insert(parent, h, b)
            held = self.blocks if tier == "host" else self.disk
            if h in held:  # (the allocation's own evictions may have pushed it out of its tier meanwhile)
                held.move_to_end(h)
            parent = h
        host = sum(tier == "host" for _, tier in found)
        disk = len(found) - host
        if host:
            self.pending_s += self.link.transfer_s(host * self.block_bytes)
            by_tier["host"] = host
        if disk:
            self.pending_s += self.disk_link.transfer_s(disk * self.block_bytes)
            by_tier["disk"] = disk
            self._to_host([h for h, tier in found if tier == "disk"])  # hot again: kept in L2 too
        self.stats["loaded"] += host
        self.stats["disk_loaded"] += disk
        return blocks, by_tier

    def take_pending_s(self) -> float:
        t, self.pending_s = self.pending_s, 0.0
        return t
