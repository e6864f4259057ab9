"""Request migration: a request whose worker died continues elsewhere from the tokens the
client already has.

The continuation is a new request (engine.messages GenerateRequest.continuation): prompt +
the tokens sent, max_tokens less by as many. Greedy gives the same tokens (same model, same
context). A seeded request draws its noise keyed by (seed, output position)
(engine/sampler.py `_mix`, which starts from seed * K + position with K odd); the
continuation's output positions restart at 0, so its seed is shifted by `sent * K^-1 mod
2^64`, which makes every position's key the original's.

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

from engine.messages import GenerateRequest, shifted_seed

__all__ = ["continuation", "shifted_seed"]


def continuation(req: GenerateRequest, sent: list[int], chars: int, attempt: int) -> GenerateRequest:
    """The request that produces what `req` has left after `sent` (0 < len(sent) < max_tokens),
    of whose text the client has `chars` characters, under its own id (the dead worker's peers
    may still hold state under the original one)."""
    return req.continuation(sent, chars, f"{req.request_id}#m{attempt}")
