"""The router's view of the prefix index: queries, live epochs, and Redis being down.

When Redis cannot be reached the view says so once in the log, reports it in status, and
answers no hits, so routing goes on by load alone (clients see no error). The router's
health loop calls refresh() every interval; the first one that reaches Redis again brings
the hits back (the workers re-publish their caches on their own, see index_publisher).
"""
from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

import redis

from cluster.registry import RegistryError
from engine.block_hash import chain_hashes, salted_root
from router.config import IndexConfig
from router.prefix_index import PrefixHit, PrefixIndex

log = logging.getLogger(__name__)


class IndexView:
    def __init__(self, redis_url: str, cfg: IndexConfig, timeout_s: float):
        self.cfg = cfg
        self.client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=timeout_s,
                                           socket_connect_timeout=timeout_s)
        self.index: PrefixIndex | None = None  # per model id, made once the workers told us theirs
        self.model_id: str | None = None
        self.block_size = 0
        self.live: dict[str, int] = {}  # worker id -> lease epoch
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
                   ) -> dict[str, PrefixHit] | None:
        """Each live worker's leading cached blocks of the prompt; None while the index is unusable."""
        if not self.available or self.index is None:
            return None
        live = {w: self.live[w] for w in worker_ids if w in self.live}
        try:
            hits = await asyncio.to_thread(self.index.query, self.hashes(prompt, cache_salt), live)
        except redis.RedisError as exc:
            self._down(exc)
            return None
        self.queries += 1
        return hits

    async def refresh(self) -> None:
        """Re-read the live leases (and notice Redis coming back)."""
        if self.index is None:
            return
        try:
            self.live = await asyncio.to_thread(self.index.live_epochs)
        except redis.RedisError as exc:
            self._down(exc)
            return
        if not self.available:
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
