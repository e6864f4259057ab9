"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

A seeded request draws its noise from a generator keyed by (seed, output position), so
its tokens do not depend on which other requests share the batch, nor on preemption.
"""
from __future__ import annotations

import torch

from engine.sampling import SamplingParams, TokenLogprobs


class Sampler:
    def __init__(self, device: torch.device, seed: int):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 positions: list[int]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: (N, V) float32; positions: each row's output index (for seeding).

        Returns the sampled token per row and, where asked for, its logprobs.
        """
        greedy = logits.argmax(dim=-1)  # (N,)
        tokens = greedy
        if not all(p.greedy for p in params):
            tokens = torch.where(
                torch.tensor([p.greedy for p in params], device=logits.device),
                greedy, self._sample(logits, params, positions),
            )
        token_list = tokens.tolist()
        return token_list, token_logprobs(logits, token_list, [p.logprobs for p in params])

    def _sample(self, logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> torch.Tensor:
        probs = target_probs(logits, params)  # (N, V)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p.
        noise = torch.empty_like(probs)
        for i, p in enumerate(params):
            noise[i].exponential_(generator=self.generator_for(p, positions[i]))
        return (probs / noise).argmax(dim=-1)

    def generator_for(self, params: SamplingParams, position: int, stream: int = 0) -> torch.Generator:
        """The noise source of a request's output position: the shared generator, or for a seeded
        request one keyed by (seed, position, stream), so its draws never depend on the batch.
        Stream 0 is the token's own draw; speculative decoding keys its other draws by other streams."""
        if params.seed is None:
            return self.generator
        return torch.Generator(device=self.device).manual_seed(_mix(params.seed, position) ^ stream)


def sample_each_row(sampler, logits: torch.Tensor, params: list[SamplingParams],
                    positions: list[int]) -> tuple[list, list]:
    """`sampler` over the batch; if that raises, over each row alone, a row that still fails
    getting its exception in place of its token (and None as its logprobs): which request's
    parameters broke the batch is then known, and only that request fails."""
    try:
        return sampler(logits, params, positions)
    except Exception:
        tokens: list = []
        logprobs: list = []
        for i in range(len(params)):
            try:
                t, lp = sampler(logits[i:i + 1], params[i:i + 1], positions[i:i + 1])
            except Exception as exc:
                t, lp = [exc], [None]
            tokens.append(t[0])
            logprobs.append(lp[0])
        return tokens, logprobs


def target_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """(N, V) logits -> the distribution a sampled request draws from: temperature, then top-k,
    top-p and min-p, renormalised (N, V)."""
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params],
                         device=logits.device).unsqueeze(1)
    return torch.softmax(_filter(logits / temps, params), dim=-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int],
                   wants: list[int | None]) -> list[TokenLogprobs | None]:
    """Per row of logits (N, V): the raw model logprob of `tokens[row]` and the top-n, where
    `wants[row]` (n) is set."""
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    want = [i for i, n in enumerate(wants) if n is not None]
    if not want:
        return out
    lp = torch.log_softmax(logits[want], dim=-1)  # (W, V), of the raw model distribution
    top_v, top_i = lp.topk(max(max(wants[i] for i in want), 1), dim=-1)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in want], device=lp.device).unsqueeze(1)).squeeze(1).tolist()
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for row, i in enumerate(want):
        k = wants[i]
        out[i] = TokenLogprobs(tokens[i], chosen[row], list(zip(top_i[row][:k], top_v[row][:k])))
    return out


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask tokens outside top-k, the top-p nucleus or below min-p with -inf."""
    # Clamped to the vocabulary as well as checked at admission: a top_k past int64 would
    # overflow the tensor below and fail the whole batch's step.
    top_k = [min(p.top_k, logits.shape[1]) if p.top_k > 0 else logits.shape[1] for p in params]
    if all(k >= logits.shape[1] for k in top_k) and all(p.top_p >= 1 and p.min_p <= 0 for p in params):
        return logits
    dev = logits.device
    if all(p.top_p >= 1 and p.min_p <= 0 for p in params):
        # top-k alone: the k best of each row via topk, no full-vocabulary sort (~10x less
        # work at k=50 of 50k); keeps exactly the tokens the sorted path below keeps.
        k_max = max(top_k)
        best = logits.topk(k_max, dim=-1).indices  # (N, k_max), best first
        keep_rank = torch.arange(k_max, device=dev).unsqueeze(0) < torch.tensor(top_k, device=dev).unsqueeze(1)
        keep = torch.zeros_like(logits, dtype=torch.bool).scatter(1, best, keep_rank)
        return logits.masked_fill(~keep, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (N, V)
    ranks = torch.arange(logits.shape[1], device=dev).unsqueeze(0)
    drop = ranks >= torch.tensor(top_k, device=dev).unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the first token always stays).
    before = probs.cumsum(dim=-1) - probs
    drop |= before >= torch.tensor([p.top_p for p in params], device=dev).unsqueeze(1)
    drop |= probs < torch.tensor([p.min_p for p in params], device=dev).unsqueeze(1) * probs[:, :1]
    drop[:, 0] = False
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def _mix(seed: int, position: int) -> int:
    # SplitMix64-style mixing so nearby (seed, position) pairs give unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & 0x7FFFFFFFFFFFFFFF
