"""The router's view of the prefix index: queries, live epochs, and Redis being down.

When Redis cannot be reached the view says so once in the log, reports it in status, and
answers no hits, so routing goes on by load alone (clients see no error). The router's
health loop calls refresh() every interval; the first one that reaches Redis again brings
the hits back (the workers re-publish their caches on their own, see publisher.py). A query
whose candidates are not all in the last refresh's leases reads them again first.
"""
from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import redis

from engine.block_hash import chain_hashes, salted_root
from router.config import IndexConfig
from router.index.query import PrefixHit, PrefixIndex
from router.index.registry import RegistryError

log = logging.getLogger(__name__)
REREAD_S = 0.05  # bounds the extra reads while a candidate's lease stays missing (it re-registers soon, or dies)


class IndexView:
    def __init__(self, redis_url: str, cfg: IndexConfig, timeout_s: float, recent_s: float = 5.0):
        self.cfg = cfg
        self.recent = RecentRoutes(recent_s)
        self.client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.index: PrefixIndex | None = None  # per model id, made once the workers told us theirs
        self.model_id: str | None = None
        self.block_size = 0
        self.live: dict[str, int] = {}  # worker id -> lease epoch
        self._reread_at = float("-inf")  # when a candidate missing from `live` last made us read it again
        self.available = False
        self.error: str | None = "not checked yet"
        self.queries = 0
        try:
            self.client.ping()
        except redis.AuthenticationError as exc:  # never carry on without the password
            raise RegistryError(f"Redis at {re.sub(r'//[^@/]*@', '//***@', redis_url)} refused us: {exc}") from None
        except redis.RedisError as exc:
            self._down(exc)

    def bind(self, model_id: str, block_size: int) -> None:
        """The model id and block size the workers hash with (every worker must agree)."""
        if self.model_id is not None and (model_id, block_size) != (self.model_id, self.block_size):
            raise ValueError(f"worker runs {model_id!r} with {block_size}-token blocks; others run "
                             f"{self.model_id!r} with {self.block_size}")
        self.model_id, self.block_size = model_id, block_size
        self.index = PrefixIndex(self.client, self.cfg.key_prefix, model_id)

    def hashes(self, prompt: Sequence[int], cache_salt: str | None) -> list[bytes]:
        usable = max(0, len(prompt) - 1) // self.block_size * self.block_size  # the last token is always computed
        return chain_hashes(prompt[:usable], self.block_size, self.model_id, parent=salted_root(cache_salt))

    async def hits(self, prompt: Sequence[int], cache_salt: str | None, worker_ids: Sequence[str]
                   ) -> tuple[list[bytes], dict[str, PrefixHit]] | None:
        """The prompt's block hashes and each live worker's leading cached blocks of them; None
        while the index is unusable. Blocks this router sent to a worker moments ago count as
        held there on device (their events may not be published yet)."""
        if not self.available or self.index is None:
            return None

        def ask() -> tuple[list[bytes], dict[str, PrefixHit], dict[str, int]]:  # off the event loop: hashing
            live = self._live_of(worker_ids)                                   # a long prompt takes a while too
            hashes = self.hashes(prompt, cache_salt)
            return hashes, self.index.query(hashes, live), live
        try:
            hashes, hits, live = await asyncio.to_thread(ask)
        except redis.RedisError as exc:
            self._down(exc)
            return None
        self.queries += 1
        self.recent.raise_hits(hashes, hits, live)
        return hashes, hits

    def _live_of(self, worker_ids: Sequence[str]) -> dict[str, int]:
        """The lease epochs of these candidates. If one is missing from the last refresh (its lease
        came back just after it, as every lease does after a Redis restart), the leases are read
        again now, at most once per REREAD_S: else its blocks would count as none until the next
        health round, and requests meanwhile would go to a worker without their prefix."""
        if any(w not in self.live for w in worker_ids) and time.monotonic() - self._reread_at >= REREAD_S:
            self._reread_at = time.monotonic()
            self.live = self.index.live_epochs()
        return {w: self.live[w] for w in worker_ids if w in self.live}

    async def refresh(self) -> None:
        """Re-read the live leases (and notice Redis coming back)."""
        if self.index is None:
            return
        try:
            self.live = await asyncio.to_thread(self.index.live_epochs)
        except redis.RedisError as exc:
            self._down(exc)
            return
        except Exception:  # not Redis being down: a bug, or data we did not foresee; keep the last view
            log.exception("prefix index: reading the leases failed; keeping the last view")
            return
        if not self.available and self.error != "not checked yet":
            log.warning("prefix index: Redis reachable again; KV-aware routing resumes")
        self.available, self.error = True, None

    def _down(self, exc: Exception) -> None:
        if self.available or self.error == "not checked yet":
            log.warning("prefix index: Redis unreachable (%s); routing by load only until it returns", exc)
        self.available, self.error = False, f"{type(exc).__name__}: {exc}"

    def status(self) -> dict:
        return {"available": self.available, "error": self.error, "live_workers": dict(self.live),
                "model_id": self.model_id, "queries": self.queries}

    def close(self) -> None:
        self.client.close()


class RecentRoutes:
    """Prompts this router sent to each worker in the last `ttl_s` seconds: follow-ups that
    arrive before the worker published its new blocks still find them (an optimistic hint,
    like the index itself)."""

    def __init__(self, ttl_s: float, clock: Callable[[], float] = time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock  # the fleet simulator passes its virtual clock
        self.holders: dict[bytes, dict[str, float]] = {}  # block hash -> worker id -> expiry
        self._expiries: deque[tuple[float, bytes, str]] = deque()

    def note(self, hashes: Sequence[bytes], worker_id: str) -> None:
        now = self.clock()
        self._prune(now)
        for h in hashes:
            self.holders.setdefault(h, {})[worker_id] = now + self.ttl_s
            self._expiries.append((now + self.ttl_s, h, worker_id))

    def leading(self, hashes: Sequence[bytes], worker_id: str) -> int:
        now, n = self.clock(), 0
        for h in hashes:
            if self.holders.get(h, {}).get(worker_id, 0.0) <= now:
                break
            n += 1
        return n

    def raise_hits(self, hashes: Sequence[bytes], hits: dict[str, PrefixHit], workers) -> None:
        """Count blocks routed to a worker moments ago as held on its device, where the index
        does not show them yet (updates `hits` in place)."""
        for w in workers:
            soon = self.leading(hashes, w)
            if soon > hits[w].blocks:
                hits[w] = replace(hits[w], blocks=soon, device=hits[w].device + soon - hits[w].blocks)

    def _prune(self, now: float) -> None:
        while self._expiries and self._expiries[0][0] <= now:
            _, h, w = self._expiries.popleft()
            holders = self.holders.get(h)
            if holders is not None and holders.get(w, now + 1) <= now:
                del holders[w]
                if not holders:
                    del self.holders[h]
