"""A simulated engine: the engine's real Scheduler, BlockPool and RadixCache (continuous
batching, chunked prefill, preemption, the prefix cache with LRU eviction and its cache
events), with the model forward replaced by a cost model's step time.

It mirrors LLMEngine's step (engine/llm_engine.py) for the three roles without tokens or
logits: every sampled token is OUT_TOKEN, and a request finishes on max_tokens (an answer's
length is the workload's business). A prefill engine keeps a request's blocks after its
first token until the decode side took them (`release`); a decode engine reserves blocks
before the KV arrives and `admit`s the request into them.
"""
from __future__ import annotations

import itertools
from typing import Protocol

from engine.block_pool import BlockPool
from engine.cache_events import CacheEventLog
from engine.config import SchedulerConfig
from engine.messages import GenerateRequest
from engine.radix_cache import RadixCache
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.step_log import StepLog
from sim.cost import StepWork
from sim.hardware import LinkProfile
from sim.hicache import SimHostTier

OUT_TOKEN = 1  # what every simulated sample returns


class StepCost(Protocol):
    def step_s(self, work: StepWork) -> float:
        """Seconds one step of this work takes."""

    def decode_steps_s(self, batch: int, context: int, steps: int) -> list[float]:
        """Seconds of each of `steps` decode steps of `batch` sequences whose contexts sum to
        `context` at the first (each step adds one token to every sequence)."""


class SimEngine:
    def __init__(self, role: str, sched: SchedulerConfig, num_blocks: int, block_size: int, model_id: str,
                 cost: StepCost, prefix_cache: bool = True, record_events: bool = False):
        self.role, self.block_size, self.cost = role, block_size, cost
        self.pool = BlockPool(num_blocks)
        self.cache = RadixCache(self.pool, CacheEventLog(record_events)) if prefix_cache else None
        self.scheduler = Scheduler(sched, self.pool, self.cache, block_size, model_id)
        self.host: SimHostTier | None = None  # HiCache's host (and disk) tiers, when attach_host() was called
        self._loads_s = 0.0  # the last planned step's load-back time
        self.seqs: dict[str, Sequence] = {}  # scheduled here (waiting or running)
        self.prefilled: dict[str, Sequence] = {}  # prefill role: first token out, blocks held for the decode side
        self.reservations: dict[str, list[int]] = {}  # decode role: blocks held for a KV on its way
        self._arrivals = itertools.count()
        # The served engine's record of its steps (engine/step_log.py): wall = the step on the
        # virtual clock (what its host made of it), CPU = the cost model's step alone.
        self.step_log = StepLog()

    def attach_host(self, capacity_blocks: int, block_bytes: int, link: LinkProfile, disk_blocks: int = 0,
                    disk_link: LinkProfile | None = None) -> None:
        """Put a host-memory tier, and a disk tier under it when disk_blocks > 0 (sim/hicache.py),
        under this engine's prefix cache."""
        if self.cache is None:
            raise ValueError("a host tier needs the prefix cache")
        self.host = SimHostTier(self.cache, self.pool, capacity_blocks, block_bytes, link, disk_blocks, disk_link)
        self.scheduler.loader = self.host

    # -- requests -----------------------------------------------------------------------
    def add(self, req: GenerateRequest) -> Sequence:
        seq = Sequence(req.request_id, list(req.prompt_token_ids), req.params, next(self._arrivals),
                       cache_salt=req.cache_salt)
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def reserve(self, request_id: str, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size)
        if request_id in self.reservations or not self.pool.can_allocate(need):
            return False
        self.reservations[request_id] = self.pool.allocate(need)
        return True

    def admit(self, req: GenerateRequest, first_token: int, cached_tokens: int = 0) -> Sequence | None:
        """A prefilled request into its reserved blocks; None when the first token finished it."""
        prompt = list(req.prompt_token_ids)
        seq = Sequence(req.request_id, prompt, req.params, next(self._arrivals), token_ids=prompt + [first_token],
                       num_computed=len(prompt), block_table=self.reservations.pop(req.request_id),
                       num_cached_tokens=cached_tokens, cache_salt=req.cache_salt)
        self.scheduler.register_blocks(seq)
        if req.params.max_tokens <= 1:
            self.pool.release(seq.block_table)
            return None
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def release(self, request_id: str) -> bool:
        """Free what a request holds here (prefilled blocks or a reservation); False if nothing."""
        seq = self.prefilled.pop(request_id, None)
        if seq is not None:
            self.pool.release(seq.block_table)
            seq.block_table = []
            return True
        blocks = self.reservations.pop(request_id, None)
        if blocks is not None:
            self.pool.release(blocks)
            return True
        return False

    def abort(self, request_id: str) -> bool:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return self.release(request_id)
        self.scheduler.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
        return True

    # -- the step -----------------------------------------------------------------------
    def plan(self) -> tuple[list[ScheduledSeq], float]:
        """This step's batch (its blocks allocated) and how long the step takes."""
        batch = self.scheduler.schedule()
        self._raise_failures()
        if not batch:
            return batch, 0.0
        work = StepWork.of((s.num_new_tokens, s.seq.num_computed, s.samples) for s in batch)
        self._loads_s = self.host.take_pending_s() if self.host is not None else 0.0  # blocks brought back
        return batch, self.cost.step_s(work) + self._loads_s

    def steady_steps(self, batch: list[ScheduledSeq], cap: int) -> list[float]:
        """The step times of up to `cap` repeats of a pure-decode batch that the scheduler
        would plan unchanged: every running sequence decodes, none waits, none needs a new
        block or finishes before the last repeat. [] when the batch is not such a batch.
        Repeating it by arithmetic (finish(batch, repeats)) is what lets a 12,000-request
        trace run in seconds; the step cost still follows each step's growing context."""
        if self.scheduler.waiting or len(batch) != len(self.scheduler.running) or cap < 2 or self._loads_s:
            return []
        k, ctx = cap, 0
        for s in batch:
            seq = s.seq
            if s.num_new_tokens != 1:
                return []
            k = min(k, len(seq.block_table) * self.block_size - seq.num_computed,
                    seq.params.max_tokens - len(seq.output_token_ids))
            ctx += seq.num_computed
        return self.cost.decode_steps_s(len(batch), ctx, k) if k >= 2 else []

    def finish(self, batch: list[ScheduledSeq], repeats: int = 1) -> list[Sequence]:
        """Complete a planned step (`repeats` times, for a batch steady_steps allowed):
        record the computed tokens, sample, and finish or hand over sequences. Returns the
        sequences that got a token (status FINISHED, PREFILLED or RUNNING)."""
        batch = [s for s in batch if s.seq.finish_reason != "abort"]  # aborted during the step
        if repeats > 1:
            for s in batch:  # all but the last repeat; the last is the ordinary step below
                s.seq.num_computed += repeats - 1
                s.seq.token_ids.extend((OUT_TOKEN,) * (repeats - 1))
        sampled = [s.seq for s in batch if s.samples]
        self.scheduler.after_step(batch)
        self._raise_failures()
        for seq in sampled:
            seq.token_ids.append(OUT_TOKEN)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"
                self.scheduler.remove(seq)
                del self.seqs[seq.request_id]
            elif self.role == "prefill":
                self.scheduler.remove(seq, release=False)
                seq.status = SequenceStatus.PREFILLED
                self.prefilled[seq.request_id] = self.seqs.pop(seq.request_id)
        return sampled

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def _raise_failures(self) -> None:
        """A served engine fails one request whose own scheduling raised; here no client waits
        for an answer and every input is the simulator's own, so such a failure is a bug: raise it."""
        failures = self.scheduler.take_failures()
        if failures:
            raise failures[0].error

    def take_events(self) -> list:
        return self.cache.events.take() if self.cache is not None else []

    def stats(self) -> dict:
        cs = self.cache.stats if self.cache is not None else None
        return {"num_blocks": self.pool.num_blocks, "free_blocks": self.pool.num_free,
                "referenced_blocks": self.pool.num_referenced, "cached_blocks": len(self.cache) if self.cache else 0,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "prefilled": len(self.prefilled), "reserved": len(self.reservations),
                "preemptions": self.scheduler.num_preemptions,
                "prefix_hit_rate": cs.hit_rate if cs else 0.0, "evicted_blocks": cs.evicted_blocks if cs else 0,
                "step_times": self.step_log.snapshot(),
                **({"host_tier": {**self.host.stats, "blocks": len(self.host.blocks),
                                  "disk_blocks": len(self.host.disk)}} if self.host else {})}
