"""Prompt lookup: propose what followed the latest earlier occurrence of the context's last n-gram.

No model: an input-grounded task (rewrite, summarise, edit code) copies long runs of its
prompt, and the context itself predicts them. Longest n first (n down to n_min): a longer
match is likelier to continue the same way.
"""
from __future__ import annotations

import numpy as np

from engine.config import SpeculativeConfig
from engine.sequence import Sequence
from engine.spec.drafter import Proposal


class NgramDrafter:
    def __init__(self, cfg: SpeculativeConfig):
        self.n_max = cfg.n
        self.n_min = min(cfg.n_min, cfg.n)

    def propose(self, seqs: list[Sequence], ks: list[int]) -> list[Proposal]:
        return [Proposal(lookup(seq.token_ids, k, self.n_min, self.n_max) if k else []) for seq, k in zip(seqs, ks)]

    def release(self, request_id: str) -> None:
        pass  # keeps nothing per request

    def stats(self) -> dict:
        return {}


def lookup(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens (largest n
    in [n_min, n_max] that occurs); [] when none does."""
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(n_max, len(arr) - 1), n_min - 1, -1):
        # Windows that start before the final n-gram itself and end before the last token.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)  # (L-n, n)
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start : start + k].tolist()
    return []
