"""Cache events: what a worker tells the prefix index about the blocks it holds.

An engine records one event per change of a named block's presence in a tier: `stored`
when a full block becomes findable by its hash in `tier`, `removed` when it stops being
findable there. A move between tiers is a `stored` in the new tier followed by a `removed`
in the old one, so a reader never sees the block absent in between. Events are in the
order the engine made the changes; publishers batch them, they never reorder them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Tier = Literal["device", "host", "disk"]
TIERS: tuple[Tier, ...] = ("device", "host", "disk")  # fastest first


@dataclass(frozen=True)
class CacheEvent:
    kind: Literal["stored", "removed"]
    tier: Tier
    hashes: tuple[bytes, ...]  # chained block hashes (engine.block_hash)


class CacheEventLog:
    """Collects events until taken; off (and free) unless someone will read them."""

    def __init__(self, enabled: bool = False):
        self.enabled = enabled
        self._events: list[CacheEvent] = []

    def record(self, kind: Literal["stored", "removed"], tier: Tier, hashes: tuple[bytes, ...]) -> None:
        if self.enabled and hashes:
            self._events.append(CacheEvent(kind, tier, hashes))

    def take(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events
