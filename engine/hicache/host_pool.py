"""L2: KV blocks in host memory under a byte budget, least recently used evicted first."""
from __future__ import annotations

from collections import OrderedDict

import torch


class HostPool:
    """hash -> one block's KV, (2, L, bs, Hkv, hd) on the CPU. Engine thread only."""

    def __init__(self, budget: int, pin: bool = False):
        self.budget = budget
        self.pin = pin  # pinned pages make host <-> CUDA copies asynchronous and faster
        self.blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.used_bytes = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def get(self, h: bytes) -> torch.Tensor | None:
        kv = self.blocks.get(h)
        if kv is not None:
            self.blocks.move_to_end(h)
        return kv

    def put(self, h: bytes, kv: torch.Tensor) -> tuple[bool, list[tuple[bytes, torch.Tensor]]]:
        """Keep a copy of `kv` (the caller's tensor is not retained). Returns (stored, evicted):
        evicted are the least recently used blocks pushed out to make room, oldest first."""
        if h in self.blocks:
            self.blocks.move_to_end(h)
            return True, []
        size = kv.numel() * kv.element_size()
        evicted: list[tuple[bytes, torch.Tensor]] = []
        while self.blocks and self.used_bytes + size > self.budget:
            old, old_kv = self.blocks.popitem(last=False)
            self.used_bytes -= old_kv.numel() * old_kv.element_size()
            evicted.append((old, old_kv))
        if self.used_bytes + size > self.budget:
            return False, evicted
        copy = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.pin)
        copy.copy_(kv)  # from a device view: a synchronous device -> host copy
        self.blocks[h] = copy
        self.used_bytes += size
        return True, evicted

    def pop(self, h: bytes) -> torch.Tensor | None:
        kv = self.blocks.pop(h, None)
        if kv is not None:
            self.used_bytes -= kv.numel() * kv.element_size()
        return kv
