"""HiCache: host-memory (L2) and disk (L3) tiers under the device block pool (L1).

The radix tree names blocks and points at device block ids only; `TierManager` knows
where else a block's bytes live and moves them between tiers.
"""
from engine.hicache.disk_store import DiskStore
from engine.hicache.host_pool import HostPool
from engine.hicache.tier_manager import TierManager

__all__ = ["DiskStore", "HostPool", "TierManager"]
