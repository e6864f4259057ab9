"""The trace rows and the per-request record: what loadtest's trace replay reads and its runner
records, and what sim/ reuses for its simulated requests (sim/ may import this one module of
loadtest, nothing else of it: ../shared/DESIGN.md). Only the standard library, so the simulator
loads none of the load generator with it.

A Mooncake trace is one JSON object a line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` is milliseconds from the trace's start; each hash id names one block of
`block_size` prompt tokens (512 in Mooncake's traces), so two requests whose hash ids begin
alike share that prefix. Scaling: `length_scale` shrinks or grows every block (and so every
input length) alike, which keeps sharing intact while fitting a small model's context;
`output_scale` scales output lengths; `time_scale` stretches (>1) or compresses (<1) the timeline.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path


class TraceFormatError(ValueError):
    pass


def load_rows(path: Path) -> list[dict]:
    """The trace's rows, each checked for the fields and types a replay needs."""
    rows = []
    with Path(path).open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                ok = (isinstance(row, dict) and isinstance(row.get("hash_ids"), list) and row["hash_ids"]
                      and all(isinstance(row.get(k), (int, float)) for k in ("timestamp", "input_length",
                                                                             "output_length")))
            except ValueError:
                ok = False
            if not ok:
                raise TraceFormatError(f"{path}:{n}: expected a JSON object with timestamp, input_length, "
                                       f"output_length and a non-empty hash_ids list, got {line[:80]!r}")
            rows.append(row)
    return rows


@dataclass(frozen=True)
class TraceRow:
    """One request of a trace window, scaled: its blocks' hash ids, `block` tokens each, the
    last one partial (`input_len` tokens in all), and its arrival from the window's start."""

    index: int  # its place in the window
    arrival_s: float
    hash_ids: tuple[int, ...]
    block: int
    input_len: int
    output_len: int


def read_trace(path: str | Path, block_size: int = 512, length_scale: float = 1.0, output_scale: float = 1.0,
               time_scale: float = 1.0, num_prompts: int | None = None, start_s: float = 0.0,
               window_s: float | None = None) -> list[TraceRow]:
    """The trace's requests in [start_s, start_s + window_s) (the first `num_prompts` of them)."""
    if length_scale <= 0 or output_scale <= 0 or time_scale <= 0:
        raise ValueError("trace length, output and time scales must be > 0")
    rows = [r for r in load_rows(Path(path)) if r["timestamp"] / 1000 >= start_s
            and (window_s is None or r["timestamp"] / 1000 < start_s + window_s)]
    rows = rows[:num_prompts] if num_prompts else rows
    block = max(1, round(block_size * length_scale))
    out = []
    for i, row in enumerate(rows):
        ids = tuple(int(h) for h in row["hash_ids"])
        # The last block is partial: the input length decides how much of it, within the blocks given.
        n_in = math.ceil(row["input_length"] * length_scale)
        n_in = min(len(ids) * block, max((len(ids) - 1) * block + 1, n_in))
        out.append(TraceRow(i, (row["timestamp"] / 1000 - start_s) * time_scale, ids, block, n_in,
                            max(1, round(row["output_length"] * output_scale))))
    return out


@dataclass
class RequestRecord:
    """One measured (or simulated) request. Times are seconds; `start_s` is since the run began,
    chunk times are since the request was sent."""

    request_id: str
    session_id: str
    turn: int
    start_s: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def itls_s(self) -> list[float]:
        """The gaps between consecutive token-carrying chunks."""
        return [b - a for a, b in zip(self.chunk_times_s, self.chunk_times_s[1:])]

    @property
    def tpot_s(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1): the first token excluded; None with fewer than two."""
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Every SLO (seconds per key: ttft, tpot, itl, e2el) met; an ITL SLO bounds every gap of the
    request. A failed request meets none."""
    if not record.ok:
        return False
    values = {"ttft": record.ttft_s, "tpot": record.tpot_s or 0.0, "e2el": record.e2e_s,
              "itl": max(record.itls_s, default=0.0)}
    return all(values[k] is not None and values[k] <= limit for k, limit in slo.items())
