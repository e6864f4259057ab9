"""Mooncake trace replay at fleet scale: requests that keep the trace's block structure without
holding its tokens.

A row `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids": [...]}` names each
`block_size`-token block of the prompt by a hash id (512 tokens in Mooncake's traces; two
requests whose ids begin alike share that prefix). loadtest's trace workload turns each id into
random tokens, which a 12,000-request trace cannot afford in memory; here a prompt is its ids,
and its tokens (block k of id h is `block` copies of h) are made only while the request runs.
Same prefix sharing at the token level, so the router's and the engine's real block hashes see
exactly the trace's sharing. The rows, their checks and their scaling are loadtest's
(loadtest/records.py), the one module of loadtest sim/ imports.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from loadtest.records import TraceFormatError, read_trace

__all__ = ["TraceFormatError", "TracePrompt", "TraceRequest", "from_trace", "ideal_hit_ratio", "load_trace"]


@dataclass(frozen=True)
class TracePrompt:
    """A prompt as its blocks' hash ids; `list(prompt)` gives its tokens."""

    hash_ids: tuple[int, ...]
    block: int  # tokens per hash id, after length scaling
    length: int  # tokens, the last block partial

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[int]:
        return iter(self.tokens())

    def tokens(self) -> list[int]:
        out: list[int] = []
        for h in self.hash_ids:
            out += [h] * self.block
        del out[self.length:]
        return out


@dataclass(frozen=True)
class TraceRequest:
    request_id: str
    arrival_s: float
    prompt: TracePrompt
    output_len: int


def from_trace(requests: list[TraceRequest]):
    """The requests as one-turn simulated sessions."""
    from sim.fleet import SimSession

    return [SimSession(r.request_id, r.arrival_s, ((r.prompt, r.output_len),)) for r in requests]


def load_trace(path: str | Path, block_size: int = 512, length_scale: float = 1.0, output_scale: float = 1.0,
               time_scale: float = 1.0, num_prompts: int | None = None, start_s: float = 0.0,
               window_s: float | None = None) -> list[TraceRequest]:
    """The trace's requests in [start_s, start_s + window_s), arrival times from the window's start."""
    return [TraceRequest(f"trace-{row.index}", row.arrival_s, TracePrompt(row.hash_ids, row.block, row.input_len),
                         row.output_len)
            for row in read_trace(path, block_size, length_scale, output_scale, time_scale, num_prompts, start_s,
                                  window_s)]


def ideal_hit_ratio(requests: list[TraceRequest]) -> float:
    """Prompt tokens found in one infinite cache that keeps every block it ever saw, over all
    prompt tokens: the most any routing policy and cache size can reach. As the engine does,
    a hit stops at the first missing block and never covers the prompt's last token."""
    seen: set[tuple[int, int]] = set()  # (parent chain key, hash id): a chained name like the engine's
    hit = total = 0
    for r in requests:
        p = r.prompt
        usable = (p.length - 1) // p.block  # full blocks before the last token
        key, run = 0, True
        for h in p.hash_ids[:usable]:
            link = (key, h)
            run = run and link in seen
            hit += p.block if run else 0
            seen.add(link)
            key = hash(link)
        total += p.length
    return hit / total if total else 0.0
