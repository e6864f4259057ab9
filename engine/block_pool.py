"""Fixed-size KV blocks with reference counts.

A block is in exactly one state: free (on the free list), referenced (ref > 0), or cached
and unreferenced (held by the RadixCache, evictable). The pool owns ref counts; the
cache owns which blocks are named by a hash.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol


class NoFreeBlocks(RuntimeError):
    """Not enough free or evictable blocks for an allocation."""


class Evictor(Protocol):
    def is_cached(self, block_id: int) -> bool: ...
    def on_unreferenced(self, block_id: int) -> None: ...
    def on_referenced(self, block_id: int) -> None: ...
    def num_evictable(self) -> int: ...
    def evict(self, n: int) -> list[int]: ...


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free_list: deque[int] = deque(range(num_blocks))
        self.evictor: Evictor | None = None

    @property
    def num_free(self) -> int:
        """Blocks an allocation can get now (free plus evictable cached ones)."""
        return len(self.free_list) + (self.evictor.num_evictable() if self.evictor else 0)

    @property
    def num_referenced(self) -> int:
        return sum(1 for r in self.ref_counts if r > 0)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocks(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        if n > len(self.free_list):
            self.free_list.extend(self.evictor.evict(n - len(self.free_list)))
        blocks = [self.free_list.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def ref(self, blocks: list[int]) -> None:
        """Take a reference on blocks found in the cache (referenced or evictable)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                self.evictor.on_referenced(b)  # only cached blocks can be found unreferenced
            self.ref_counts[b] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            self.ref_counts[b] -= 1
            assert self.ref_counts[b] >= 0, f"block {b} released more often than referenced"
            if self.ref_counts[b] == 0:
                if self.evictor is not None and self.evictor.is_cached(b):
                    self.evictor.on_unreferenced(b)
                else:
                    self.free_list.append(b)
