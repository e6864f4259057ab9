"""The prefix index's Redis keys and values (the layout in query.py's docstring), shared by
the router's query and the workers' publishers."""
from __future__ import annotations

TIER_BITS = {"device": 1, "host": 2, "disk": 4}
EPOCH_SHIFT = 8  # value = epoch * 8 + mask


class IndexKeys:
    def __init__(self, prefix: str, model_id: str):
        self.base = f"{prefix}:{model_id}"

    def block(self, h: bytes) -> str:
        return f"{self.base}:blk:{h.hex()}"

    def pub(self, worker_id: str) -> str:
        return f"{self.base}:pub:{worker_id}"

    def resync(self, worker_id: str) -> str:
        return f"{self.base}:resync:{worker_id}"


def encode(epoch: int, mask: int) -> int:
    return epoch * EPOCH_SHIFT + mask
