"""The one interface both drafters (prompt lookup, draft model) implement."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.sequence import Sequence


@dataclass
class Proposal:
    """Tokens proposed to follow a sequence's tokens, and the distribution each was drawn from.

    `probs` is (len(tokens), V): row i is q_i, the draft's distribution at proposed token i.
    None: every token is a point mass (prompt lookup, or a greedy draft), q_i(tokens[i]) = 1.
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Drafter(Protocol):
    """Proposes tokens for running sequences. It may keep per-request state (a draft model's KV):
    it owns that state, reads the sequences' tokens and never changes them."""

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        """Up to ks[i] tokens to follow seqs[i].token_ids (fewer, or none, when it has no guess
        or no room); one Proposal per sequence, in order. ks[i] 0 asks for none (the sequence
        is prefilling): a drafter that keeps per-request state may use it to catch up."""

    def release(self, request_id: str) -> None:
        """The request left the engine (finished, aborted, failed): free what is kept for it."""

    def stats(self) -> dict:
        """Counters for the engine's stats() (a draft pool's blocks)."""
