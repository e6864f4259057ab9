"""Radix prefix cache over chained block hashes.

Each node names one full KV block by its chained hash; a path from the root is a cached
prefix. Unreferenced blocks stay cached until the pool needs them, then leaves are
evicted least-recently-used first (a parent goes only after its children). The tree
knows block ids only: where a block's bytes live is the block pool's business.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_hash import ROOT
from engine.block_pool import BlockPool
from engine.cache_events import CacheEventLog


@dataclass(eq=False)
class RadixNode:
    hash: bytes
    block_id: int
    parent: RadixNode | None
    children: dict[bytes, RadixNode] = field(default_factory=dict)
    last_access: int = 0


class TierListener(Protocol):
    """Lower cache tiers (engine.hicache) follow the device tier through these calls."""

    def on_insert(self, h: bytes, block_id: int) -> None: ...
    def on_evict(self, blocks: list[tuple[bytes, int]]) -> None:
        """Called before the evicted blocks are reused, so their bytes can still be read."""


@dataclass
class CacheStats:
    queried_blocks: int = 0
    hit_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class RadixCache:
    def __init__(self, pool: BlockPool, events: CacheEventLog | None = None):
        self.pool = pool
        self.events = events or CacheEventLog()
        pool.evictor = self
        self.root = RadixNode(ROOT, -1, None)
        self.by_hash: dict[bytes, RadixNode] = {ROOT: self.root}
        self.by_block: dict[int, RadixNode] = {}
        self.stats = CacheStats()
        self.listener: TierListener | None = None
        self._clock = 0
        self._unreferenced = 0
        self._heap: list[tuple[int, int, RadixNode]] = []  # (last_access, block_id, node), lazily invalidated

    def __len__(self) -> int:
        return len(self.by_block)

    def match(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`. Does not take references."""
        self._clock += 1
        node, blocks = self.root, []
        for h in hashes:
            node = node.children.get(h)
            if node is None:
                break
            node.last_access = self._clock
            blocks.append(node.block_id)
        self.stats.queried_blocks += len(hashes)
        self.stats.hit_blocks += len(blocks)
        return blocks

    def insert(self, parent: bytes, h: bytes, block_id: int) -> bool:
        """Name a referenced, fully computed block. False if the hash is already cached
        (the caller's block stays private) or its parent was evicted meanwhile."""
        parent_node = self.by_hash.get(parent)
        if parent_node is None or h in self.by_hash or block_id in self.by_block:
            return False
        self._clock += 1
        node = RadixNode(h, block_id, parent_node, last_access=self._clock)
        parent_node.children[h] = node
        self.by_hash[h] = node
        self.by_block[block_id] = node
        self.events.record("stored", "device", (h,))
        if self.listener is not None:
            self.listener.on_insert(h, block_id)
        return True

    # -- Evictor protocol, called by BlockPool --------------------------------------
    def is_cached(self, block_id: int) -> bool:
        return block_id in self.by_block

    def on_unreferenced(self, block_id: int) -> None:
        self._unreferenced += 1
        node = self.by_block[block_id]
        if not node.children:
            heapq.heappush(self._heap, (node.last_access, block_id, node))

    def on_referenced(self, block_id: int) -> None:
        self._unreferenced -= 1

    def num_evictable(self) -> int:
        return self._unreferenced

    def evict(self, n: int) -> list[int]:
        freed: list[int] = []
        gone: list[bytes] = []
        while len(freed) < n and self._heap:
            stamp, block_id, node = heapq.heappop(self._heap)
            if self.by_block.get(block_id) is not node or node.children or self.pool.ref_counts[block_id] > 0:
                continue  # stale: evicted, has children again, or referenced
            if node.last_access != stamp:  # touched since it was queued: requeue at its new age
                heapq.heappush(self._heap, (node.last_access, block_id, node))
                continue
            parent = node.parent
            del parent.children[node.hash]
            del self.by_hash[node.hash]
            del self.by_block[block_id]
            self._unreferenced -= 1
            self.stats.evicted_blocks += 1
            gone.append(node.hash)
            freed.append(block_id)
            if parent is not self.root and not parent.children and self.pool.ref_counts[parent.block_id] == 0:
                heapq.heappush(self._heap, (parent.last_access, parent.block_id, parent))
        if self.listener is not None and gone:
            self.listener.on_evict(list(zip(gone, freed)))  # may store them lower before they leave
        for h in gone:
            self.events.record("removed", "device", (h,))
        return freed
