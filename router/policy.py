"""Which worker takes a request: the KV-aware rule and the baselines (pure functions).

kv_aware, for a prefill (or mixed) worker w, in token units of prefill work:

    ttft(w) = queued(w)                                   # prompt tokens it still has to prefill
            + prompt - cache_weight * cached(w)           # this request's work, less its cached prefix
            + host_load_cost * host_tokens(w) + disk_load_cost * disk_tokens(w)

where cached(w) counts the leading blocks the index says w holds (at most the blocks before
the prompt's last token, which is always recomputed) and host/disk_tokens those of them found
only in a slower tier. A cached token weighs cache_weight (6) queued tokens, not 1: sending a
request away from its prefix saves it a wait but has the fleet compute that prefix again,
and everything queued later waits for that work too. Measured on the Mooncake conversation
trace (16 simulated workers, sim_bench's hit-ratio run): weight 1 kept 0.79 of the ideal hit
ratio (0.86 on its first 2,000 requests even with no guard at all: the estimate itself traded
the cache away), weight 4 0.94, weight 6 0.96, for a p90 TTFT 4% higher at the trace's load.
A hit shorter than min_hit_fraction of the prompt counts as none:
otherwise a prefix every request shares (a system prompt) would pull each new conversation
onto the first worker that cached it, and the other workers' caches would sit idle. Guard:
a worker whose queued(w) exceeds the least queued worker's by more than
max(balance_slack_tokens, balance_slack_prompts * prompt) is not a candidate, so one hot
prefix cannot pile everything on one worker (the weight alone lets a holder fall at most
cache_weight prompts behind). Ties (a new
conversation on idle workers) go to fewer requests in flight, then to the worker that was
routed the fewest requests (spreading new conversations, and so the cache), then the id.
A decode worker is picked by the batch it runs and the room it has left (kv_aware), or by
the baseline. The rules are pure functions; `Picker` applies them to the live pool.
"""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from engine.messages import GenerateRequest
from router.config import RouterConfig
from router.index.query import PrefixHit

if TYPE_CHECKING:
    from router.index.view import IndexView
    from router.pool import WorkerPool, WorkerRef


class Candidate(Protocol):
    worker_id: str
    inflight: int
    queued_tokens: int
    routed: int  # requests routed there so far


def cached_tokens(hit: PrefixHit, prompt_len: int, block_size: int) -> int:
    return min(hit.blocks, max(0, (prompt_len - 1) // block_size)) * block_size


def ttft_cost(w: Candidate, hit: PrefixHit, prompt_len: int, block_size: int, cfg: RouterConfig) -> float:
    cached = cached_tokens(hit, prompt_len, block_size)
    if cached < cfg.min_hit_fraction * prompt_len:
        cached = 0
    usable = cached // block_size
    # Count the slow tiers among the usable blocks, slowest last (the query counts device first).
    slow = max(0, usable - hit.device)
    host = min(hit.host, slow)
    disk = max(0, slow - host)
    return (w.queued_tokens + prompt_len - cfg.cache_weight * cached
            + block_size * (cfg.host_load_cost * host + cfg.disk_load_cost * disk))


def pick_kv_aware(pool: Sequence[Candidate], hits: Mapping[str, PrefixHit], prompt_len: int, block_size: int,
                  cfg: RouterConfig) -> Candidate:
    least = min(w.queued_tokens for w in pool)
    slack = max(cfg.balance_slack_tokens, cfg.balance_slack_prompts * prompt_len)
    eligible = [w for w in pool if w.queued_tokens <= least + slack]
    return min(eligible, key=lambda w: (ttft_cost(w, hits.get(w.worker_id, PrefixHit()), prompt_len, block_size, cfg),
                                        w.inflight, w.routed, w.worker_id))


def pick_least_loaded(pool: Sequence[Candidate]) -> Candidate:
    return min(pool, key=lambda w: (w.inflight, w.queued_tokens, w.routed, w.worker_id))


class RoundRobin:
    def __init__(self) -> None:
        self.next: dict[str, int] = {}

    def pick(self, role: str, pool: Sequence[Candidate]) -> Candidate:
        ordered = sorted(pool, key=lambda w: w.worker_id)
        i = self.next.get(role, 0)
        self.next[role] = i + 1
        return ordered[i % len(ordered)]


def pick_random(pool: Sequence[Candidate], rng: random.Random) -> Candidate:
    return rng.choice(sorted(pool, key=lambda w: w.worker_id))


class Picker:
    """The routing policy over the live pool: which prefill (or mixed) worker computes a
    prompt, which decode worker continues it. `cfg` may be swapped at run time (set_policy)."""

    def __init__(self, cfg: RouterConfig, pool: WorkerPool, index: IndexView | None = None):
        self.cfg, self.pool, self.index = cfg, pool, index
        self._round_robin = RoundRobin()
        self._rng = random.Random()
        # kv_aware decisions: by the index, and how many went elsewhere than the longest hit (load won)
        self.kv_picks = {"by_index": 0, "load_over_hit": 0}

    async def prefill(self, role: str, req: GenerateRequest, exclude: set[str] = frozenset()) -> tuple[WorkerRef, int]:
        """The worker that computes the prompt, and the uncached tokens it is charged with."""
        needs_peer = role == "prefill" and req.params.max_tokens > 1
        pool, n = self.pool.candidates(role, exclude, needs_peer=needs_peer), len(req.prompt_token_ids)
        answer = None
        if self.cfg.policy == "kv_aware" and self.index is not None:
            answer = await self.index.hits(req.prompt_token_ids, req.cache_salt, [w.worker_id for w in pool])
            pool = self.pool.candidates(role, exclude, needs_peer=needs_peer)  # health may have changed meanwhile
        if answer is None:
            w = self._by_load(role, pool)
            w.routed += 1
            return w, n
        hashes, hits = answer
        w = pick_kv_aware(pool, hits, n, self.index.block_size, self.cfg)
        self.kv_picks["by_index"] += 1
        best = max((hits.get(v.worker_id, PrefixHit()).blocks for v in pool), default=0)
        self.kv_picks["load_over_hit"] += hits.get(w.worker_id, PrefixHit()).blocks < best
        self.index.recent.note(hashes, w.worker_id)
        w.routed += 1
        return w, n - cached_tokens(hits.get(w.worker_id, PrefixHit()), n, self.index.block_size)

    def decode(self, exclude: set[str], peer_of: WorkerRef) -> WorkerRef:
        pool = self.pool.candidates("decode", exclude, peer_of)
        if self.cfg.policy == "kv_aware":  # the batch it runs and the room it has left
            return min(pool, key=lambda w: (w.inflight + w.running, -w.free_blocks, w.worker_id))
        return self._by_load("decode", pool)

    def _by_load(self, role: str, pool: list[WorkerRef]) -> WorkerRef:
        if self.cfg.policy == "round_robin":
            return self._round_robin.pick(role, pool)
        if self.cfg.policy == "random":
            return pick_random(pool, self._rng)
        return pick_least_loaded(pool)
