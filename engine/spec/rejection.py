"""Verification: which proposed tokens the target keeps, and the one token it adds.

Standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023): proposal d_i, drawn
from q_i, is accepted with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection
the target's token is drawn from max(0, p_i - q_i), renormalised; when all k are accepted a
bonus token is drawn from p_k. Every emitted token is then distributed exactly as the
target's own sample. p_i is the target's distribution as the request samples it
(temperature, top-k, top-p, min-p: engine.sampler.target_probs). Prompt lookup's q is a
point mass (accept with probability p(d)). Greedy is the limit where p is a point mass on
the argmax: accept while the proposal is the argmax, then emit the argmax.
"""
from __future__ import annotations

import torch

from engine.sampler import Sampler, target_probs
from engine.sampling import SamplingParams
from engine.spec.drafter import Proposal

ACCEPT_STREAM = 0xACCE_97ED  # the accept test's uniform at a position, apart from the token's own draw


def verify_batch(logits: torch.Tensor, proposals: list[Proposal], params: list[SamplingParams],
                 positions: list[int], sampler: Sampler) -> list[list[int]]:
    """logits: the rows of several proposing sequences back to back, 1 + k_i each (V wide).
    One target_probs call for every sampled row, then each sequence's own accept test."""
    rows = [1 + len(p.tokens) for p in proposals]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    sampled = [i for i, sp in enumerate(params) if not sp.greedy]
    probs: dict[int, torch.Tensor] = {}
    if sampled:
        index = [r for i in sampled for r in range(starts[i], starts[i] + rows[i])]
        flat = target_probs(logits[index], [params[i] for i in sampled for _ in range(rows[i])])
        at = 0
        for i in sampled:
            probs[i] = flat[at : at + rows[i]]
            at += rows[i]
    return [verify(logits[starts[i] : starts[i] + rows[i]], probs.get(i), proposals[i], params[i], positions[i],
                   sampler) for i in range(len(proposals))]


def verify(logits: torch.Tensor, p: torch.Tensor | None, proposal: Proposal, params: SamplingParams,
           position: int, sampler: Sampler) -> list[int]:
    """logits: (k+1, V) target rows, row i predicting the token after proposal i - 1 (row 0: after
    the last verified token); p: their target_probs, for a sampled request; `position`: the output
    index of the first proposed token. Returns the accepted proposals followed by one token from
    the target (1 to k+1 tokens)."""
    d = proposal.tokens
    k = len(d)
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()  # (k+1,)
        a = 0
        while a < k and d[a] == best[a]:
            a += 1
        return d[:a] + [best[a]]
    if p is None:
        p = target_probs(logits, [params] * (k + 1))  # (k+1, V)
    rows = torch.arange(k, device=p.device)
    idx = torch.tensor(d, device=p.device)
    p_d = p[rows, idx]  # (k,)
    q_d = proposal.probs[rows, idx] if proposal.probs is not None else torch.ones_like(p_d)
    u = _uniforms(k, params, position, sampler, p.device)
    # u < p/q has probability min(1, p/q); a token the target cannot emit (p = 0) is never kept.
    rejected = (u * q_d >= p_d).tolist()
    a = rejected.index(True) if True in rejected else k
    if a == k:
        residual = p[k]  # every proposal kept: the bonus token, from the target alone
    else:
        if proposal.probs is not None:
            q = proposal.probs[a]
        else:  # prompt lookup: a point mass on its token
            q = torch.zeros_like(p[a]).index_fill_(0, idx[a:a + 1], 1.0)
        residual = (p[a] - q).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q up to rounding: nothing to correct
            residual = p[a]
    noise = torch.empty_like(residual).exponential_(generator=sampler.generator_for(params, position + a))
    return d[:a] + [int((residual / noise).argmax())]  # exponential race: samples the normalised residual


def _uniforms(k: int, params: SamplingParams, position: int, sampler: Sampler, device) -> torch.Tensor:
    """(k,) uniforms in [0, 1), a seeded request's keyed by position so they never depend on the batch."""
    if params.seed is None:
        return torch.rand(k, generator=sampler.generator, device=device)
    return torch.cat([torch.rand(1, generator=sampler.generator_for(params, position + i, ACCEPT_STREAM),
                                 device=device) for i in range(k)])
