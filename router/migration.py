"""Request migration: a request whose worker died continues elsewhere from the tokens the
client already has.

The continuation is a new request: prompt + the tokens sent, max_tokens less by as many.
Greedy gives the same tokens (same model, same context). A seeded request draws its noise
keyed by (seed, output position) (engine/sampler.py `_mix`, which starts from
seed * K + position with K odd); the continuation's output positions restart at 0, so its
seed is shifted by `sent * K^-1 mod 2^64`, which makes every position's key the original's.

Text: the client has the text of the tokens sent only up to what the dead worker's
detokenizer handed out. It held back the tail that might start a stop string (the longest
stop string less one character) and any incomplete UTF-8 character; a stop string may have
begun in the tokens sent and end in the new ones; and a tokenizer may decode a token
differently after others than alone. So the continuation does not detokenize its own tokens
alone: its params carry `resumed_tokens` (the prompt's last len(sent) tokens are output) and
`resumed_chars` (the characters the client has), and every engine that runs it (mixed,
prefill, decode) seeds its detokenizer with them (engine/tokenizer.py
IncrementalDetokenizer). The new engine then sees the same text the dead one did, matches
stop strings over it, holds back and hands out exactly as the fault-free run would, from the
client's next character on. The alternative, matching stop strings at the router over the
concatenated stream, would need a second detokenizer and holdback beside the engine's, on
every request and not only migrated ones; this way the engine stays the one place that
turns tokens into text.
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


def continuation(req: GenerateRequest, sent: list[int], chars: int, attempt: int) -> GenerateRequest:
    """The request that produces what `req` has left after `sent` (0 < len(sent) < max_tokens),
    of whose text the client has `chars` characters, under its own id (the dead worker's peers
    may still hold state under the original one)."""
    params = req.params
    if params.seed is not None:
        params = dataclasses.replace(params, seed=shifted_seed(params.seed, len(sent)))
    params = dataclasses.replace(params, max_tokens=params.max_tokens - len(sent),
                                 resumed_tokens=len(sent), resumed_chars=chars)
    return dataclasses.replace(req, request_id=f"{req.request_id}#m{attempt}",
                               prompt_token_ids=[*req.prompt_token_ids, *sent], params=params)
