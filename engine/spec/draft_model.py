"""A smaller model with the target's vocabulary proposes tokens, each from its own distribution.

The draft keeps, per request, a mirror Sequence in its own KV pool and prefix cache. Before
proposing it syncs the mirror to the target's tokens: KV of tokens the target rejected is
dropped (num_computed cut to the common prefix, tail blocks freed), then one pass computes
the tokens it has not seen (all of the prompt the first time, e.g. on a decode worker that
got the target's KV from a prefill worker) and proposes the first token; k - 1 one-token
passes propose the rest. Its proposals are drawn from the same sampling parameters' filtered
distribution as the target's (argmax for greedy requests), whose rows go to verification.

That first pass holds at most `chunk_tokens` tokens (the engine's max_num_batched_tokens), so
a step's draft work stays as bounded as the target's: mirrors that are caught up go first,
then the ones catching up (a prompt, or steps without proposals), oldest request first, whole
while they fit; the first that does not fit computes what is left of the budget (a catch-up
chunk) and proposes in a later step, once caught up; the rest wait. A request with no
proposals decodes one token as without speculation, so the tokens are the same either way.
Each later pass holds one token per proposing mirror, fewer than the first pass had. While
the target prefills a prompt, the speculator asks for no proposals (k 0) and the draft uses
what is left of its budget to catch up on that prompt, so it can propose from the first decode.

Disaggregated with speculative.draft_kv "ship", the prompt's draft KV is computed where the
target's is: a prefill engine's drafter computes it (export_prompt) and it travels with the
target's KV; the decode engine's drafter reserves blocks for it (reserve), has it written into
them (write) and adopts them as the request's mirror at admission (adopt), so the first decode
step proposes without computing the prompt.
"""
from __future__ import annotations

import torch

from engine.block_pool import BlockPool
from engine.model_runner import ModelRunner
from engine.radix_cache import RadixCache
from engine.sampler import Sampler, target_probs
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.drafter import Proposal

DRAFT_STREAM = 0x5EED_D4AF  # the draft's draws at a position, apart from the target's (Sampler.generator_for)


def _packing(s: ScheduledSeq) -> tuple[bool, int]:
    """Decodes first (the runner packs them first), then catch-up chunks by length (grouped)."""
    return s.num_new_tokens != 1, s.num_new_tokens


class DraftModelDrafter:
    def __init__(self, runner: ModelRunner, pool: BlockPool, cache: RadixCache | None, block_size: int,
                 model_id: str, sampler: Sampler, chunk_tokens: int = 2048):
        self.runner, self.pool, self.cache = runner, pool, cache
        self.block_size, self.model_id, self.sampler = block_size, model_id, sampler
        # Tokens of one step's first draft pass, and export_prompt's pass size: the step budget
        # bounds the draft's activations and how long co-batched decodes wait for it.
        self.chunk_tokens = chunk_tokens
        self.mirrors: dict[str, Sequence] = {}
        self.reserved: dict[str, list[int]] = {}  # decode role: blocks an incoming draft KV goes into
        self.computed_tokens = 0  # tokens the draft model ran, prompts and proposals (stats)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        props = [Proposal([]) for _ in seqs]
        synced = [(i, self._sync(seq, k)) for i, (seq, k) in enumerate(zip(seqs, ks))]
        live, catch_up = self._share_budget([(i, m) for i, m in synced if m is not None], ks)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i, _ in live}
        while live:
            tokens, qs = self._pass(live, catch_up, seqs)
            catch_up = []  # chunks ride the first pass only, and get no logits row
            nxt = []
            for (i, m), token, q in zip(live, tokens, qs):
                props[i].tokens.append(token)
                if q is not None:
                    probs[i].append(q)
                m.token_ids.append(token)
                if len(props[i].tokens) < ks[i]:
                    nxt.append((i, m))
            live = nxt
        if catch_up:  # no mirror proposes: only catch-up chunks compute this step
            self._compute(catch_up)
        for i, qs in probs.items():
            if qs:
                props[i].probs = torch.stack(qs)  # (k, V)
        return props

    def _pass(self, live: list[tuple[int, Sequence]], catch_up: list[ScheduledSeq], seqs: list[Sequence]):
        """One draft pass: every live mirror computes what it has not seen (catch-up chunks ride
        along) and draws its next proposal token."""
        batch = [ScheduledSeq(m, m.num_tokens - m.num_computed) for _, m in live] + catch_up
        batch.sort(key=_packing)
        order = {id(s.seq): j for j, s in enumerate(s for s in batch if s.samples)}
        logits = self._compute(batch)  # (B, V), a row per sampling mirror in batch order
        rows = [order[id(m)] for _, m in live]
        return self._draw(logits[rows], [seqs[i].params for i, _ in live],
                          [m.num_tokens - m.num_prompt_tokens for _, m in live])

    def _compute(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        """The draft model's forward over `batch`, packed as the runner wants; its logits."""
        batch.sort(key=_packing)
        logits = self.runner.run(batch)
        for s in batch:
            self.computed_tokens += s.num_new_tokens
            s.seq.num_computed += s.num_new_tokens
        return logits

    def _share_budget(self, mirrors: list[tuple[int, Sequence]], ks: list[int]) -> tuple[
            list[tuple[int, Sequence]], list[ScheduledSeq]]:
        """This step's first pass within chunk_tokens: the mirrors that compute all they have not
        seen and propose (back in request order), and catch-up chunks, which propose in a later
        step (no logits row: a chunk stops short of its mirror's last token). A mirror asked
        for no proposals (k 0: its target is prefilling) catches up to its last token; one that
        does not fit takes what is left of the budget. Mirrors within a step's proposals of the
        target go first, so a long catch-up never stops the others proposing; catch-ups then go
        oldest request first, so each finishes and none starves."""
        def order(im: tuple[int, Sequence]) -> tuple[bool, int]:
            i, m = im
            return m.num_tokens - m.num_computed > ks[i] + 1, m.arrival

        budget, live, chunks = self.chunk_tokens, [], []
        for i, m in sorted(mirrors, key=order):
            unseen = m.num_tokens - m.num_computed
            if ks[i] and unseen <= budget:
                live.append((i, m))
                budget -= unseen
                continue
            n = min(unseen - 1, budget)
            if n > 0:
                chunks.append(ScheduledSeq(m, n))
                budget -= n
        live.sort(key=lambda im: im[0])
        return live, chunks

    def _draw(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]):
        """Proposal tokens from the draft's logits (N, V) at these output positions, and each one's
        q (V,) (None for a greedy request: a point mass on the argmax)."""
        tokens = logits.argmax(dim=-1).tolist()
        qs: list[torch.Tensor | None] = [None] * len(params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            q = target_probs(logits[sampled], [params[i] for i in sampled])  # (S, V)
            noise = torch.empty_like(q)
            unseeded = [j for j, i in enumerate(sampled) if params[i].seed is None]
            if unseeded:  # one draw for all: the shared generator's stream is per engine anyway
                noise[unseeded] = torch.empty((len(unseeded), q.shape[1]), device=q.device).exponential_(
                    generator=self.sampler.generator)
            for j, i in enumerate(sampled):
                if params[i].seed is not None:
                    noise[j].exponential_(generator=self.sampler.generator_for(params[i], positions[i], DRAFT_STREAM))
            picks = (q / noise).argmax(dim=-1).tolist()
            for j, i in enumerate(sampled):
                tokens[i], qs[i] = picks[j], q[j]
        return tokens, qs

    def _sync(self, seq: Sequence, k: int) -> Sequence | None:
        """The request's mirror, matched to the target's tokens, with blocks for k proposals; None
        (and nothing kept) when the draft pool has no room."""
        m = self.mirrors.get(seq.request_id)
        if m is None:
            m = Sequence(seq.request_id, list(seq.prompt_token_ids), seq.params, seq.arrival,
                         token_ids=list(seq.token_ids), cache_salt=seq.cache_salt)
            self._match_prefix(m)
            self.mirrors[seq.request_id] = m
        else:
            common = _common_prefix(m.token_ids, seq.token_ids)
            m.token_ids = list(seq.token_ids)
            # At most all but the last token: its logits give the first proposal (a step whose
            # proposals the target never verified left the mirror ahead of the target's tokens).
            m.num_computed = min(m.num_computed, common, m.num_tokens - 1)
            self._trim(m, m.num_computed)
            self._register(m)
        # KV slots for the unseen tokens and all but the last proposal.
        need = -(-(m.num_tokens + k - 1) // self.block_size) - len(m.block_table)
        if need > 0:
            if not self.pool.can_allocate(need):
                self.release(seq.request_id)
                return None
            m.block_table += self.pool.allocate(need)
        return m

    def _trim(self, m: Sequence, num_tokens: int) -> None:
        keep = max(-(-num_tokens // self.block_size), m.num_registered_blocks)  # cached blocks stay
        if len(m.block_table) > keep:
            self.pool.release(m.block_table[keep:])
            del m.block_table[keep:]

    def _match_prefix(self, m: Sequence) -> None:
        if self.cache is None:
            return
        hashes = m.update_block_hashes(self.block_size, self.model_id)
        hit = self.cache.match(hashes[: (m.num_tokens - 1) // self.block_size])  # the last token stays to compute
        self.pool.ref(hit)
        m.block_table, m.num_computed, m.num_registered_blocks = hit, len(hit) * self.block_size, len(hit)

    def _register(self, m: Sequence) -> None:
        """Offer the mirror's full, verified blocks to the draft's prefix cache (as Scheduler.register_blocks)."""
        if self.cache is None:
            return
        full = m.num_computed // self.block_size
        if full <= m.num_registered_blocks:
            return
        hashes = m.update_block_hashes(self.block_size, self.model_id)
        for i in range(m.num_registered_blocks, full):
            if i and self.cache.by_block.get(m.block_table[i - 1]) is not self.cache.by_hash.get(hashes[i - 1]):
                break  # only extend our own cached chain
            self.cache.insert(hashes[i - 1] if i else self.cache.root.hash, hashes[i], m.block_table[i])
        m.num_registered_blocks = full

    # -- draft KV shipped with the target's (disaggregated) ------------------------------
    def export_prompt(self, seq: Sequence, num_tokens: int) -> torch.Tensor | None:
        """Prefill role: the draft's KV of seq's first `num_tokens` tokens, (2, L', nb, bs, H', hd'),
        computed now (from the draft's prefix cache where it hits) and copied out; its blocks go
        back at once (full ones stay cached). None when the draft's pool has no room: the decode
        side's draft then computes the prompt itself."""
        m = Sequence(seq.request_id, seq.token_ids[:num_tokens], seq.params, seq.arrival, cache_salt=seq.cache_salt)
        self._match_prefix(m)
        need = -(-num_tokens // self.block_size) - len(m.block_table)
        if need > 0 and not self.pool.can_allocate(need):
            self.pool.release(m.block_table)
            return None
        m.block_table += self.pool.allocate(need) if need > 0 else []
        while m.num_computed < m.num_tokens:  # the last chunk's one logits row is not needed
            n = min(m.num_tokens - m.num_computed, self.chunk_tokens)
            self.runner.run([ScheduledSeq(m, n)])
            m.num_computed += n
            self.computed_tokens += n
        self._register(m)
        kv = self.runner.read_blocks(m.block_table)
        self.pool.release(m.block_table)
        return kv

    def reserve(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Decode role: blocks for an incoming draft KV of `num_tokens` tokens; None when the
        draft's pool has no room (the request then comes without its draft KV)."""
        need = -(-num_tokens // self.block_size)
        if request_id in self.reserved or request_id in self.mirrors or not self.pool.can_allocate(need):
            return None
        self.reserved[request_id] = self.pool.allocate(need)
        return self.reserved[request_id]

    def write(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write a received draft KV into reserved blocks (which no mirror uses yet)."""
        self.runner.write_blocks(block_ids, kv)

    def adopt(self, seq: Sequence, num_tokens: int) -> None:
        """Decode role, at admission: the request's reserved blocks, holding the draft's KV of its
        first `num_tokens` tokens, become its mirror (the next _sync registers their full blocks
        in the draft's prefix cache and computes only what follows)."""
        blocks = self.reserved.pop(seq.request_id, None)
        if blocks is None:
            return
        self.release(seq.request_id)
        self.mirrors[seq.request_id] = Sequence(
            seq.request_id, list(seq.prompt_token_ids), seq.params, seq.arrival,
            token_ids=list(seq.token_ids[:num_tokens]), num_computed=num_tokens, block_table=blocks,
            cache_salt=seq.cache_salt)

    def release(self, request_id: str) -> None:
        m = self.mirrors.pop(request_id, None)
        if m is not None:
            self.pool.release(m.block_table)
            m.block_table = []
        reserved = self.reserved.pop(request_id, None)
        if reserved is not None:
            self.pool.release(reserved)

    def stats(self) -> dict:
        return {"draft_num_blocks": self.pool.num_blocks, "draft_free_blocks": self.pool.num_free,
                "draft_referenced_blocks": self.pool.num_referenced,
                "draft_requests": len(self.mirrors) + len(self.reserved), "draft_computed_tokens": self.computed_tokens}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
