"""The engine's side of speculative decoding: extend a step's decodes with proposals before the
target pass, verify them after it, and roll back what was rejected.

propose() turns a decode of one token into a verification of 1 + k: the proposals are
appended to the sequence's tokens, its block table grows to hold their KV, and the runner
computes the k + 1 positions in the same pass as the rest of the batch (a small multi-token
chunk: the chunked-prefill attention path), returning a logits row for each. verify() keeps
the accepted proposals (engine.spec.rejection), cuts the sequence back to them and frees the
blocks only the rejected ones used, before the scheduler counts computed tokens and offers
full blocks to the prefix cache: rejected tokens' KV is never cached. rewind() then leaves
the accepted run off the sequence so the engine appends it token by token with its usual
stop checks (stop strings, stop tokens, max_tokens landing inside the run).

A drafter is an optimisation, so its failures never fail a request: when propose() raises,
each request is drafted alone to find whose input broke it; a request whose drafting fails
gets no proposals this step (it decodes one token, as without speculation), its draft state
is dropped and the failure is logged once with a log id. After MAX_DRAFT_FAILURES a request
decodes without proposals to its end. When drafting fails for every one of two or more
requests in MAX_DRAFT_FAILURES steps in a row, the drafter itself is broken (its model's
forward, not any one request's input): speculation is off for the engine's life, logged once.
"""
from __future__ import annotations

import logging
import uuid

import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig, Role, SpeculativeConfig
from engine.model_config import ModelConfig
from engine.sampler import Sampler
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from engine.spec.adaptive import AdaptiveK
from engine.spec.drafter import Drafter, Proposal
from engine.spec.rejection import verify_batch

log = logging.getLogger(__name__)

MAX_DRAFT_FAILURES = 3  # a request's failed draftings, and the steps in a row the whole drafter failed


class Speculator:
    def __init__(self, cfg: SpeculativeConfig, drafter: Drafter, pool: BlockPool, block_size: int,
                 sampler: Sampler, max_model_len: int, max_batched_tokens: int):
        self.cfg, self.drafter, self.pool, self.block_size = cfg, drafter, pool, block_size
        self.sampler, self.max_model_len, self.max_batched_tokens = sampler, max_model_len, max_batched_tokens
        self.policy = AdaptiveK(cfg)
        self.proposals: dict[str, Proposal] = {}  # this step's, by request id
        self.draft_failures: dict[str, int] = {}  # by request id, while it runs
        self.failed_steps = 0  # steps in a row in which drafting failed for every request
        self.num_draft_failures = 0  # (stats)
        self.off = False  # the drafter failed for everyone too often: no more proposals

    def propose(self, batch: list[ScheduledSeq]) -> None:
        """Extend eligible decodes of `batch` with proposals (in place; the batch is re-packed
        plain decodes first, as the runner wants)."""
        if self.off:
            return
        cands, ks = self._candidates(batch)
        # Prefill chunks ask for no proposals: a draft model catches up on their prompts meanwhile.
        warm = [s for s in batch if (s.num_new_tokens > 1 or not s.samples) and self._speculates(s.seq)]
        if not cands and not warm:
            return
        for s, prop in zip(cands, self._draft(cands + warm, ks + [0] * len(warm))):
            self._extend(s, prop)
        # Plain decodes first by context (as the scheduler packs them), then verifications by
        # length (the runner attends each run of equal length in one call), then prefill chunks.
        batch.sort(key=lambda s: (s.num_new_tokens != 1, not s.num_draft, s.num_draft,
                                  s.seq.num_computed if s.num_new_tokens == 1 or s.num_draft else 0))

    def _candidates(self, batch: list[ScheduledSeq]) -> tuple[list[ScheduledSeq], list[int]]:
        """The decodes that propose this step and how many tokens each, within the step's room."""
        decodes = [s for s in batch if s.num_new_tokens == 1 and s.samples]
        compute_bound = len(decodes) > self.cfg.max_batch
        room = self.max_batched_tokens - sum(s.num_new_tokens for s in batch)
        cands, ks = [], []
        for s in decodes:
            seq, p = s.seq, s.seq.params
            if room <= 0:
                break
            if not self._speculates(seq) or seq.num_tokens == seq.num_prompt_tokens:
                continue
            if compute_bound and (p.seed is None or p.greedy):  # a seeded sample keeps its k: batch-independent
                continue
            k = min(self.policy.k_for(seq.request_id), p.max_tokens - len(seq.output_token_ids) - 1,
                    self.max_model_len - seq.num_tokens - 1, room)
            if k > 0:
                cands.append(s)
                ks.append(k)
                room -= k
        return cands, ks

    def _extend(self, s: ScheduledSeq, prop: Proposal) -> None:
        """A decode becomes a verification of its proposal (when its blocks can grow to hold it)."""
        k, seq = len(prop.tokens), s.seq
        need = -(-(seq.num_tokens + k) // self.block_size) - len(seq.block_table)
        if k == 0 or (need > 0 and not self.pool.can_allocate(need)):
            return  # no guess, or no room: a plain decode this step
        if need > 0:
            seq.block_table += self.pool.allocate(need)
        seq.token_ids += prop.tokens
        s.num_new_tokens, s.num_draft = 1 + k, k
        self.proposals[seq.request_id] = prop

    def _speculates(self, seq: Sequence) -> bool:
        p = seq.params
        return p.speculate and p.max_tokens > 1 and self.draft_failures.get(seq.request_id, 0) < MAX_DRAFT_FAILURES

    def _draft(self, cands: list[ScheduledSeq], ks: list[int]) -> list[Proposal]:
        """The drafter's proposals for cands; an empty one for each request whose drafting fails."""
        seqs = [s.seq for s in cands]
        try:
            props = self.drafter.propose(seqs, ks)
            self.failed_steps = 0
            return props
        except Exception as exc:  # whose input broke it? each alone says
            batch_exc = exc
        props, failed = [], 0
        for seq, k in zip(seqs, ks):
            try:
                props += self.drafter.propose([seq], [k])
            except Exception as exc:
                failed += 1
                self._draft_failed(seq.request_id, exc)
                props.append(Proposal([]))
        if failed < len(seqs):
            self.failed_steps = 0
            if not failed:  # the batch failed, yet each alone drafted: say so once
                log.warning("drafting a batch of %d failed, each request alone drafted (log id %s)",
                            len(seqs), uuid.uuid4().hex[:12], exc_info=batch_exc)
        elif failed > 1:
            self.failed_steps += 1
            if self.failed_steps >= MAX_DRAFT_FAILURES:
                self.off = True
                log.error("the %s drafter failed for every request in %d steps in a row: speculative "
                          "decoding is off for this engine (requests decode one token per step); "
                          "check the draft model, then restart the engine", self.cfg.method, self.failed_steps)
        return props

    def _draft_failed(self, request_id: str, exc: Exception) -> None:
        """No proposals for this request this step; its draft state goes (the next try starts clean)."""
        self.num_draft_failures += 1
        n = self.draft_failures[request_id] = self.draft_failures.get(request_id, 0) + 1
        after = "it decodes without proposals to its end" if n >= MAX_DRAFT_FAILURES else \
            "it decodes without proposals this step"
        log.error("drafting for request %s failed (%d of %d); %s (log id %s)", request_id, n,
                  MAX_DRAFT_FAILURES, after, uuid.uuid4().hex[:12], exc_info=exc)
        try:
            self.drafter.release(request_id)
        except Exception:
            log.exception("releasing the draft state of request %s failed", request_id)

    def verify(self, items: list[tuple[ScheduledSeq, torch.Tensor]]) -> list[list[int] | Exception]:
        """(proposing sequence, its logits (k+1, V)) -> the tokens each emits (accepted + one), or
        the exception that failed it (it is then as before propose()). Cuts each sequence back to
        its accepted proposals and frees blocks only the rejected ones used."""
        props = [self.proposals.pop(s.seq.request_id) for s, _ in items]
        params = [s.seq.params for s, _ in items]
        positions = [s.seq.num_tokens - s.num_draft - s.seq.num_prompt_tokens for s, _ in items]
        logits = torch.cat([rows for _, rows in items]) if len(items) > 1 else items[0][1]
        try:
            runs: list = verify_batch(logits, props, params, positions, self.sampler)
        except Exception:  # which request's parameters broke it? each alone says
            runs = []
            for (_, rows), prop, p, pos in zip(items, props, params, positions):
                try:
                    runs += verify_batch(rows, [prop], [p], [pos], self.sampler)
                except Exception as exc:
                    runs.append(exc)
        for (s, _), tokens in zip(items, runs):
            if isinstance(tokens, Exception):
                self.cancel(s)
            else:
                self._keep(s, len(tokens) - 1)
        return runs

    def _keep(self, s: ScheduledSeq, a: int) -> None:
        seq, k = s.seq, s.num_draft
        base = seq.num_tokens - k  # tokens before the proposals
        del seq.token_ids[base + a:]
        s.num_new_tokens = 1 + a
        keep = -(-(base + a) // self.block_size)  # KV of the verified token and the accepted run
        if len(seq.block_table) > keep:
            self.pool.release(seq.block_table[keep:])
            del seq.block_table[keep:]
        seq.num_draft_tokens += k
        seq.num_accepted_tokens += a
        seq.num_spec_steps += 1
        self.policy.update(seq.request_id, k, a)

    def cancel(self, s: ScheduledSeq) -> None:
        """Undo propose() for one sequence (its verification failed): tokens as before (its blocks
        go when the engine fails it)."""
        self.proposals.pop(s.seq.request_id, None)
        del s.seq.token_ids[s.seq.num_tokens - s.num_draft:]
        s.num_new_tokens, s.num_draft = 1, 0

    @staticmethod
    def rewind(batch: list[ScheduledSeq]) -> None:
        """After the scheduler counted the step: take the accepted run off each proposing sequence
        again (its KV stays computed), for the engine to append with stop checks."""
        for s in batch:
            if s.num_draft:
                del s.seq.token_ids[s.seq.num_computed - s.num_new_tokens + 1:]

    def forget(self, request_id: str) -> None:
        self.policy.forget(request_id)
        self.draft_failures.pop(request_id, None)
        self.drafter.release(request_id)
        self.proposals.pop(request_id, None)

    def stats(self) -> dict:
        return {"speculative": self.cfg.method, "spec_drafter_off": self.off,
                "spec_draft_failures": self.num_draft_failures, **self.drafter.stats()}


def build_speculator(cfg: EngineConfig, target: ModelConfig, pool: BlockPool, sampler: Sampler,
                     max_model_len: int) -> Speculator | None:
    """The engine's Speculator, or None when speculation is off or the engine never decodes."""
    spec = cfg.speculative
    if not spec.enabled or cfg.role == Role.PREFILL:
        return None
    if spec.method == "ngram":
        from engine.spec.ngram import NgramDrafter

        drafter: Drafter = NgramDrafter(spec)
    else:
        drafter = _draft_model(cfg, target, pool.num_blocks, sampler)
    return Speculator(spec, drafter, pool, cfg.cache.block_size, sampler, max_model_len,
                      cfg.scheduler.max_num_batched_tokens)


def build_draft_kv(cfg: EngineConfig, target: ModelConfig, pool: BlockPool, sampler: Sampler,
                   speculator: Speculator | None):
    """The draft model whose prompt KV this engine exports (prefill role: a draft of its own, that
    only prefills) or imports (decode role: its speculator's) with the target's KV, or None:
    speculative.draft_kv is not "ship", or there is no draft model."""
    from engine.spec.draft_model import DraftModelDrafter

    spec = cfg.speculative
    if spec.method != "draft" or spec.draft_kv != "ship" or cfg.role == Role.MIXED:
        return None
    if cfg.role == Role.PREFILL:
        return _draft_model(cfg, target, pool.num_blocks, sampler)
    drafter = speculator.drafter if speculator is not None else None
    return drafter if isinstance(drafter, DraftModelDrafter) else None


def _draft_model(cfg: EngineConfig, target: ModelConfig, target_blocks: int, sampler: Sampler):
    from engine.engine_setup import build_parts
    from engine.spec.draft_model import DraftModelDrafter

    spec = cfg.speculative
    cache = cfg.cache.model_copy(update={"num_blocks": spec.draft_num_blocks or target_blocks,
                                         "hicache": cfg.cache.hicache.model_copy(update={"enabled": False}),
                                         "record_events": False})
    draft_cfg = cfg.model_copy(update={"model": spec.draft_model, "model_id": None, "cache": cache,
                                       "quantization": spec.draft_quantization, "speculative": SpeculativeConfig()})
    parts = build_parts(draft_cfg)
    if parts.model_config.vocab_size != target.vocab_size:
        raise ValueError(f"speculative.draft_model {spec.draft_model!r} has a vocabulary of "
                         f"{parts.model_config.vocab_size} tokens, the target {target.vocab_size}: a draft "
                         "model must share the target's vocabulary (its tokenizer)")
    return DraftModelDrafter(parts.runner, parts.pool, parts.cache, cfg.cache.block_size, parts.model_id, sampler,
                             cfg.scheduler.max_num_batched_tokens)



