"""Continuous batching with chunked prefill, a prefix cache and preemption by recompute.

Each step: running sequences first (decodes and unfinished prompt chunks, oldest first),
then waiting ones while the token budget, the sequence cap and free blocks allow. When a
running sequence needs a block and none is free, the newest running sequence is
preempted: its blocks are released (full ones stay in the prefix cache) and it waits to
be recomputed. A held sequence (its reader is behind) keeps its place and its blocks but is
not scheduled, so a client that stops reading stops its request's decoding, not the batch.

An exception while scheduling one sequence (its prefix match and block hashes, a lower tier's
load-back, its chunk and blocks) or while offering its blocks to the prefix cache is that
sequence's alone: it leaves scheduling with its blocks freed and is reported in `failures`,
which the engine turns into that request's error, while the rest of the step goes on.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

from engine.block_pool import BlockPool
from engine.config import SchedulerConfig
from engine.radix_cache import RadixCache
from engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, from seq.num_computed on
    num_draft: int = 0  # of those, the last ones proposed by speculative decoding: each gets a logits row

    @property
    def samples(self) -> bool:
        """True when this step reaches the end of the sequence's tokens, so a token is sampled."""
        return self.seq.num_computed + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SeqFailure:
    """An exception one sequence's own work raised in a step: its request fails alone."""

    seq: Sequence
    error: Exception
    stage: str  # where, in words the client's error carries ("scheduling", ...)


class PrefixLoader(Protocol):
    """Lower cache tiers (engine.hicache.TierManager) that can extend a device prefix hit."""

    def load_back(self, seq: Sequence, hashes: list[bytes], num_device: int) -> tuple[list[int], dict[str, int]]:
        """Blocks continuing a referenced device hit of `num_device` blocks, now in the pool,
        cached and referenced; and the whole hit in blocks per tier."""


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, pool: BlockPool, cache: RadixCache | None,
                 block_size: int, model_id: str):
        self.cfg = cfg
        self.pool = pool
        self.cache = cache
        self.block_size = block_size
        self.model_id = model_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.loader: PrefixLoader | None = None  # set when HiCache is on
        self.failures: list[SeqFailure] = []  # since the last take_failures(), out of scheduling

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_runnable(self) -> bool:
        """Something to schedule: held sequences alone leave the engine idle, not spinning."""
        return bool(self.waiting) or any(not seq.held for seq in self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Choose this step's work and allocate its blocks. Decodes (one new token) come first,
        shortest context first; then prefill chunks in scheduling order."""
        budget = self.cfg.max_num_batched_tokens
        batch: list[ScheduledSeq] = []
        preempted = self._schedule_running(batch, budget)
        budget -= sum(s.num_new_tokens for s in batch)
        if not preempted:
            self._schedule_waiting(batch, budget)
        # Decodes first, by context length (the runner groups similar lengths for attention).
        batch.sort(key=lambda s: (s.num_new_tokens != 1, s.seq.num_computed if s.num_new_tokens == 1 else 0))
        return batch

    def _schedule_running(self, batch: list[ScheduledSeq], budget: int) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            try:
                n = 0 if seq.held else self._chunk(seq, seq.num_tokens - seq.num_computed, budget)
                need = self._blocks_needed(seq, n) if n else 0
            except Exception as exc:
                self._fail(seq, exc, "scheduling")
                continue
            if n == 0:
                i += 1
                continue
            while not self.pool.can_allocate(need) and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
            if not self.pool.can_allocate(need):
                self._preempt(self.running.pop(i))
                preempted = True
                continue
            try:
                seq.block_table += self.pool.allocate(need)
            except Exception as exc:
                self._fail(seq, exc, "scheduling")
                continue
            batch.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        return preempted

    def _schedule_waiting(self, batch: list[ScheduledSeq], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            try:
                n = self._admit(seq, budget)
            except Exception as exc:
                self._fail(seq, exc, "scheduling")
                continue
            if n is None:  # its blocks are not free
                if not batch and self._reclaim_waiting():
                    continue  # the head again, with the blocks queued sequences held
                break
            if n == 0:  # its next chunk does not fit this step
                break
            batch.append(ScheduledSeq(seq, n))
            budget -= n

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Move the head of the queue to running with blocks for its next chunk, and return the
        chunk's size; 0 when the chunk does not fit the budget, None when its blocks are not free
        (both leave it at the head, holding what it held before). Whatever it references from here
        on is in its block table, so a failure frees all of it with the sequence."""
        hit, by_tier = self._match_prefix(seq) if not seq.block_table else ([], {})  # referenced
        if hit:
            seq.block_table = hit
        computed = len(hit) * self.block_size if hit else seq.num_computed
        n = self._chunk(seq, seq.num_tokens - computed, budget)
        need = -(-(computed + n) // self.block_size) - len(seq.block_table)
        if n == 0 or not self.pool.can_allocate(need):
            if hit:
                self.pool.release(hit)
                seq.block_table = []
            return 0 if n == 0 else None
        if hit:
            seq.num_computed = computed
            seq.num_registered_blocks = len(hit)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = computed
            seq.cached_by_tier = {t: b * self.block_size for t, b in by_tier.items()}
        seq.block_table += self.pool.allocate(need)
        seq.status = SequenceStatus.RUNNING
        self.waiting.popleft()
        self.running.append(seq)
        return n

    def _reclaim_waiting(self) -> bool:
        """Nothing runs and the first waiting sequence cannot get its blocks: free the blocks a
        sequence further back holds (a decode worker's imports wait holding their prompt's KV),
        as a preemption it recomputes from. Else waiting imports holding the pool between them,
        each short of one block, wait for each other for ever. False if none holds any."""
        for seq in reversed(list(self.waiting)[1:]):
            if seq.block_table:
                self.pool.release(seq.block_table)
                seq.block_table = []
                seq.num_computed = seq.num_registered_blocks = 0
                seq.num_preemptions += 1
                self.num_preemptions += 1
                return True
        return False

    def _chunk(self, seq: Sequence, remaining: int, budget: int) -> int:
        if remaining <= budget:
            return remaining
        # A preempted sequence's recompute (prompt + outputs) may outgrow any one step, so it
        # is chunked even when prompts are not.
        return budget if self.cfg.enable_chunked_prefill or seq.num_preemptions else 0

    def _match_prefix(self, seq: Sequence) -> tuple[list[int], dict[str, int]]:
        """The cached prefix's blocks, referenced, and where they were found (blocks per tier)."""
        if self.cache is None:
            return [], {}
        hashes = seq.update_block_hashes(self.block_size, self.model_id)
        # Leave at least the last token to compute: its logits give the next token.
        usable = (seq.num_tokens - 1) // self.block_size
        hit = self.cache.match(hashes[:usable])
        self.pool.ref(hit)  # before a load-back allocates: it must not evict these
        if self.loader is None:
            return hit, {"device": len(hit)} if hit else {}
        try:
            loaded, by_tier = self.loader.load_back(seq, hashes[:usable], len(hit))
        except BaseException:
            self.pool.release(hit)
            raise
        return hit + loaded, by_tier

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        return max(0, -(-(seq.num_computed + n) // self.block_size) - len(seq.block_table))

    def _preempt(self, seq: Sequence) -> None:
        self.pool.release(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered_blocks = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def after_step(self, batch: list[ScheduledSeq]) -> None:
        """Record computed tokens and offer newly completed full blocks to the prefix cache."""
        for s in batch:
            s.seq.num_computed += s.num_new_tokens
            try:
                self.register_blocks(s.seq)
            except Exception as exc:
                self._fail(s.seq, exc, "prefix caching")

    def register_blocks(self, seq: Sequence) -> None:
        if self.cache is None:
            return
        full = seq.num_computed // self.block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = seq.update_block_hashes(self.block_size, self.model_id)
        for i in range(seq.num_registered_blocks, full):
            # Only extend our own cached chain. If our copy of the parent block stayed private
            # (another sequence cached that hash first), a child hung under the other copy would
            # keep it from being evicted while counted as evictable.
            if i and self.cache.by_block.get(seq.block_table[i - 1]) is not self.cache.by_hash.get(hashes[i - 1]):
                break
            self.cache.insert(hashes[i - 1] if i else self.cache.root.hash, hashes[i], seq.block_table[i])
        seq.num_registered_blocks = full

    def take_failures(self) -> list[SeqFailure]:
        """The sequences that failed alone since the last call, already out of scheduling."""
        failures, self.failures = self.failures, []
        return failures

    def _fail(self, seq: Sequence, exc: Exception, stage: str) -> None:
        self.remove(seq)
        self.failures.append(SeqFailure(seq, exc, stage))

    def remove(self, seq: Sequence, release: bool = True) -> None:
        """Take a sequence out of scheduling; release its blocks unless the caller keeps them."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if release:
            self.pool.release(seq.block_table)
            seq.block_table = []
