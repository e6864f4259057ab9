"""Request migration: a request whose worker died continues elsewhere from the tokens the
client already has.

The continuation is a new request: prompt + the tokens sent, max_tokens less by as many.
Greedy gives the same tokens (same model, same context). A seeded request draws its noise
keyed by (seed, output position) (engine/sampler.py `_mix`, which starts from
seed * K + position with K odd); the continuation's output positions restart at 0, so its
seed is shifted by `sent * K^-1 mod 2^64`, which makes every position's key the original's.
Not carried over: a stop string spanning the tokens sent and the new ones (the new request's
detokenizer sees only its own text).
"""
from __future__ import annotations

import dataclasses

from router.types import GenerateRequest

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # engine/sampler.py _mix's multiplier
_GOLDEN_INV = pow(_GOLDEN, -1, 1 << 64)


def shifted_seed(seed: int, offset: int) -> int:
    """The seed whose output position p samples like `seed`'s position p + offset."""
    return (seed + offset * _GOLDEN_INV) & _MASK


def continuation(req: GenerateRequest, sent: list[int], attempt: int) -> GenerateRequest:
    """The request that produces what `req` has left after `sent` (0 < len(sent) < max_tokens),
    under its own id (the dead worker's peers may still hold state under the original one)."""
    params = req.params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=shifted_seed(params.seed, len(sent)))
    params = dataclasses.replace(params, max_tokens=params.max_tokens - len(sent))
    return dataclasses.replace(req, request_id=f"{req.request_id}#m{attempt}",
                               prompt_token_ids=[*req.prompt_token_ids, *sent], params=params)
