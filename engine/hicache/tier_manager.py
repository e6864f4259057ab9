"""Moves KV blocks between the device pool (L1), host memory (L2) and disk (L3).

The radix tree names blocks and knows device block ids only; this manager listens to it
(a block cached in L1, blocks evicted from L1) and keeps the lower tiers:

- L1 -> L2: `write_through` copies each block when L1 caches it (batched once per step),
  so an L1 eviction costs nothing; `write_back` copies it when L1 evicts it.
- L2 -> L3: an L2 eviction hands the block to the I/O thread, which writes its file. Until
  the file is whole the block stays readable from memory (and counts as host). At most
  WRITE_QUEUE_BLOCKS wait to be written; beyond that an eviction waits for the oldest
  write, so a slow disk slows evictions instead of losing blocks or growing memory.
- selective: with `hit_threshold` N, a block goes down a tier only once it was hit N times.
- load-back: when a request is queued, L3 reads of its prefix start on reader threads
  (`prefetch`); when it is scheduled, its L2/L3 hits are copied into freshly allocated L1
  blocks and cached there (`load_back`), so only the rest of the prompt is computed.

Every tier change is a cache event (stored in the new tier before removed from the old).
Engine thread only, except the disk store and the futures it hands to I/O threads.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from engine.block_pool import BlockPool
from engine.config import HiCacheConfig
from engine.hicache.disk_store import DiskStore
from engine.hicache.host_pool import HostPool
from engine.radix_cache import RadixCache
from engine.sequence import Sequence

log = logging.getLogger(__name__)

WRITE_QUEUE_BLOCKS = 64


class TierManager:
    def __init__(self, cfg: HiCacheConfig, runner, pool: BlockPool, cache: RadixCache, model_id: str,
                 block_size: int):
        self.cfg = cfg
        self.runner, self.pool, self.cache = runner, pool, cache
        self.events = cache.events
        self.model_id, self.block_size = model_id, block_size
        kv = runner.kv_cache  # (2, L, NB, bs, Hkv, hd)
        self.block_shape = (kv.shape[0], kv.shape[1], *kv.shape[3:])  # (2, L, bs, Hkv, hd)
        self.block_bytes = kv[:, :, 0].numel() * kv.element_size()
        self.host = HostPool(cfg.host_bytes, pin=kv.device.type == "cuda")
        self.disk: DiskStore | None = None
        self._writer = self._readers = None
        if cfg.disk_dir:
            layout = {"dtype": str(kv.dtype).removeprefix("torch."), "block_shape": list(self.block_shape)}
            self.disk = DiskStore(cfg.disk_dir, cfg.disk_bytes, model_id, layout, kv.dtype, self.block_shape)
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="hicache-write")
            self._readers = ThreadPoolExecutor(2, thread_name_prefix="hicache-read")
            if len(self.disk):  # warm restart: the prefix index learns what this worker still has
                self.events.record("stored", "disk", tuple(self.disk.index))
        self.writing: dict[bytes, tuple[torch.Tensor, Future]] = {}  # L2 evictions on their way to L3
        self.staged: dict[bytes, Future] = {}  # L3 reads started when their request was queued
        self.hits: OrderedDict[bytes, int] = OrderedDict()
        self._new: list[tuple[bytes, int]] = []  # blocks L1 cached this step, for write-through
        self._loading = False
        self.stats = {"hit_blocks": {"device": 0, "host": 0, "disk": 0}, "loaded_blocks": 0,
                      "load_back_s": 0.0, "prefetch_timeouts": 0,
                      "bytes": {"device_to_host": 0, "host_to_device": 0}}
        cache.listener = self

    # -- listener: called by the RadixCache -----------------------------------------------
    def on_insert(self, h: bytes, block_id: int) -> None:
        if self.cfg.write_policy == "write_through" and not self._loading and self._hits(h) >= self.cfg.hit_threshold:
            self._new.append((h, block_id))

    def on_evict(self, blocks: list[tuple[bytes, int]]) -> None:
        """L1 is about to reuse these blocks: keep the ones L2 lacks (their bytes are still intact)."""
        self._flush_new()
        keep = [(h, b) for h, b in blocks if h not in self.host and h not in self.writing
                and (self.disk is None or h not in self.disk) and self._hits(h) >= self.cfg.hit_threshold]
        self._copy_to_host(keep)

    # -- the engine's hooks -----------------------------------------------------------------
    def prefetch(self, seq: Sequence) -> None:
        """Start reading the request's L3 blocks into host staging (called at add_request)."""
        if self.disk is None:
            return
        hashes = seq.update_block_hashes(self.block_size, self.model_id)
        for h in hashes[: (seq.num_tokens - 1) // self.block_size]:
            if h in self.cache.by_hash or h in self.host or h in self.writing or h in self.staged:
                continue
            if h not in self.disk:
                break
            self.staged[h] = self._readers.submit(self.disk.read, h)

    def load_back(self, seq: Sequence, hashes: list[bytes], num_device: int) -> tuple[list[int], dict[str, int]]:
        """Bring the L2/L3 blocks that continue a device hit of `num_device` blocks into L1.

        Returns the new device blocks (referenced, as allocate() gives them, and cached) and
        the hit per tier in blocks. Never raises for a block that cannot be had: the prefix
        just ends there and the rest is computed.
        """
        self.poll()
        for h in hashes[:num_device]:
            self._count_hit(h)
        self.stats["hit_blocks"]["device"] += num_device
        start = time.perf_counter()
        deadline = start + self.cfg.prefetch_timeout_s if self.cfg.prefetch_policy == "best_effort" else None
        found: list[tuple[bytes, torch.Tensor, str]] = []
        limit = self.pool.num_free
        for h in hashes[num_device:]:
            if len(found) >= limit:
                break
            kv, tier = self._find(h, deadline)
            if kv is None:
                break
            found.append((h, kv, tier))
        self.forget(seq)
        if not found:
            return [], {"device": num_device} if num_device else {}
        blocks = self.pool.allocate(len(found))
        self._loading = True
        try:
            self.runner.write_blocks(blocks, torch.stack([kv for _, kv, _ in found], dim=2))  # (2, L, n, bs, Hkv, hd)
            parent = hashes[num_device - 1] if num_device else self.cache.root.hash
            for (h, kv, tier), b in zip(found, blocks):
                self.cache.insert(parent, h, b)
                parent = h
                self._count_hit(h)
                if tier == "disk" or h in self.writing:  # hot again: back in L2, as if its write were done
                    self._put_host(h, kv)
        except BaseException:  # the request fails (the scheduler's containment); its blocks must not leak
            self.pool.release(blocks)  # those cached so far stay cached, evictable: their KV is whole
            raise
        finally:
            self._loading = False
        by_tier = {"device": num_device} if num_device else {}
        for _, _, tier in found:
            by_tier[tier] = by_tier.get(tier, 0) + 1
            self.stats["hit_blocks"][tier] += 1
        self.stats["loaded_blocks"] += len(found)
        self.stats["bytes"]["host_to_device"] += len(found) * self.block_bytes
        self.stats["load_back_s"] += time.perf_counter() - start
        return blocks, by_tier

    def forget(self, seq: Sequence) -> None:
        """Drop staged reads of a request that no longer needs them."""
        for h in seq.block_hashes:
            fut = self.staged.pop(h, None)
            if fut is not None:
                fut.cancel()

    def after_step(self) -> None:
        self._flush_new()
        self.poll()

    def poll(self) -> None:
        """Record finished L3 writes and anything the disk store evicted or quarantined."""
        if self.disk is None:
            return
        done = [h for h, (_, fut) in self.writing.items() if fut.done()]
        for kind, h in self.disk.take_changes():  # every write done above has its change in here
            self.events.record(kind, "disk", (h,))
            if kind == "stored" and h in self.writing:
                self._end_write(h)
        for h in done:
            if h in self.writing:  # refused (full, over budget) or failed: the block is gone
                self._end_write(h)

    def drain(self) -> None:
        """Wait for every L3 write handed out so far, then record them."""
        for _, fut in list(self.writing.values()):
            fut.exception()
        self.poll()

    def close(self) -> None:
        if self.disk is not None:
            self.drain()
            self._writer.shutdown(wait=True)
            self._readers.shutdown(wait=True, cancel_futures=True)
            self.disk.close()

    def snapshot(self) -> dict:
        out = {**self.stats, "host_blocks": len(self.host), "host_bytes": self.host.used_bytes,
               "writing_blocks": len(self.writing)}
        if self.disk is not None:
            out.update(disk_blocks=len(self.disk), disk_bytes=self.disk.used_bytes, disk_full=self.disk.full,
                       quarantined_blocks=self.disk.stats["quarantined"], disk=dict(self.disk.stats))
            out["bytes"] = {**self.stats["bytes"], "host_to_disk": self.disk.stats["bytes_written"],
                            "disk_to_host": self.disk.stats["bytes_read"]}
        return out

    # -- moves --------------------------------------------------------------------------------
    def _flush_new(self) -> None:
        new, self._new = self._new, []
        live = [(h, b) for h, b in new if (n := self.cache.by_block.get(b)) is not None and n.hash == h
                and h not in self.host and h not in self.writing]
        self._copy_to_host(live)

    def _copy_to_host(self, blocks: list[tuple[bytes, int]]) -> None:
        """Copy device blocks into L2 (one copy each, straight from the KV cache)."""
        if not blocks:
            return
        kv_cache = self.runner.kv_cache  # (2, L, NB, bs, Hkv, hd)
        self.stats["bytes"]["device_to_host"] += len(blocks) * self.block_bytes
        for h, b in blocks:
            self._put_host(h, kv_cache[:, :, b])  # (2, L, bs, Hkv, hd), a view

    def _put_host(self, h: bytes, kv: torch.Tensor) -> None:
        if h in self.host:
            self.host.get(h)
            return
        stored, evicted = self.host.put(h, kv)
        if stored and h not in self.writing:  # a block on its way to L3 is announced as host already
            self.events.record("stored", "host", (h,))
        for old, old_kv in evicted:
            self._write_back(old, old_kv, in_host=True)
        if not stored and (self.disk is None or h not in self.disk):  # L2 cannot hold it: straight on to L3
            self._write_back(h, kv.to("cpu", copy=True), in_host=False)

    def _write_back(self, h: bytes, kv: torch.Tensor, in_host: bool) -> None:
        """A block leaving L2 (or passing it by): to L3 if it qualifies, else it is gone."""
        d = self.disk
        if h in self.writing:  # L2 took it back during its write and now lets go again: the write goes on
            return
        if d is None or d.full or h in d or self._hits(h) < self.cfg.hit_threshold:
            if in_host:
                self.events.record("removed", "host", (h,))
            return
        if len(self.writing) >= WRITE_QUEUE_BLOCKS:
            next(iter(self.writing.values()))[1].exception()  # the oldest write: wait for it
            self.poll()
        if not in_host:  # the write queue is host memory: announced there until the file is whole
            self.events.record("stored", "host", (h,))
        self.writing[h] = (kv, self._writer.submit(d.write, h, kv))

    def _end_write(self, h: bytes) -> None:
        _, fut = self.writing.pop(h)
        if fut.exception() is not None:
            log.warning("hicache: L3 write failed: %r", fut.exception())
        if h not in self.host:
            self.events.record("removed", "host", (h,))

    def _find(self, h: bytes, deadline: float | None) -> tuple[torch.Tensor | None, str]:
        kv = self.host.get(h)
        if kv is not None:
            return kv, "host"
        if h in self.writing:
            return self.writing[h][0], "host"
        if self.disk is None:
            return None, ""
        fut = self.staged.pop(h, None)
        if fut is None:
            if h not in self.disk:
                return None, ""
            fut = self._readers.submit(self.disk.read, h)
        try:
            kv = fut.result(None if deadline is None else max(0.0, deadline - time.perf_counter()))
        except FutureTimeout:
            fut.cancel()
            self.stats["prefetch_timeouts"] += 1
            return None, ""
        except (CancelledError, Exception) as e:  # a miss, never a failed step: the block is recomputed
            log.warning("hicache: L3 read of %s failed: %r", h.hex()[:16], e)
            return None, ""
        self.poll()  # a bad file was quarantined: record it
        return kv, "disk"

    def _hits(self, h: bytes) -> int:
        return self.hits.get(h, 0)

    def _count_hit(self, h: bytes) -> None:
        self.hits[h] = self.hits.get(h, 0) + 1
        self.hits.move_to_end(h)
        if len(self.hits) > 4 * self.pool.num_blocks + 65536:  # bounded: the coldest counts go first
            self.hits.popitem(last=False)
