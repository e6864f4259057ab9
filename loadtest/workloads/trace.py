"""`trace`: replay a Mooncake-format trace, one JSON object a line:

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48, ...]}

`timestamp` is milliseconds from the trace's start; each hash id names one block of
`block_size` prompt tokens (512 in Mooncake's traces), so two requests whose hash ids begin
alike share that prefix. Each hash id becomes a deterministic block of random tokens (a
function of the seed and the id), which keeps the trace's prefix sharing at the token level.

Scaling: `length_scale` shrinks or grows every block (and so every input length) alike, which
keeps sharing intact while fitting a small model's context; `output_scale` scales output
lengths; `time_scale` stretches (>1) or compresses (<1) the timeline.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

from pydantic import Field

from loadtest.types import Session, Turn
from loadtest.workloads.base import WorkloadBase
from loadtest.workloads.tokens import random_ids, render, rng_for


class TraceWorkload(WorkloadBase):
    kind: Literal["trace"] = "trace"
    path: Path = Field(description="the trace file (JSONL, Mooncake format)")
    num_prompts: int | None = Field(None, ge=1, description="the first N requests of the window (None: all)")
    start_s: float = Field(0.0, ge=0, description="skip the trace's requests before this time")
    window_s: float | None = Field(None, gt=0, description="only requests in [start_s, start_s + window_s)")
    block_size: int = Field(512, ge=1, description="tokens per hash id in the trace (Mooncake: 512)")
    length_scale: float = Field(1.0, gt=0, description="scales block size and input lengths together")
    output_scale: float = Field(1.0, gt=0)
    time_scale: float = Field(1.0, gt=0, description="multiplies timestamps: 0.5 replays twice as fast")


class TraceFormatError(ValueError):
    pass


def load_rows(path: Path) -> list[dict]:
    """The trace's rows, each checked for the fields and types this replay needs."""
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


def build(cfg: TraceWorkload) -> list[Session]:
    rows = [r for r in load_rows(cfg.path) if r["timestamp"] / 1000 >= cfg.start_s
            and (cfg.window_s is None or r["timestamp"] / 1000 < cfg.start_s + cfg.window_s)]
    rows = rows[:cfg.num_prompts] if cfg.num_prompts else rows
    block = max(1, round(cfg.block_size * cfg.length_scale))
    blocks: dict[int, list[int]] = {}

    def tokens(h: int) -> list[int]:
        if h not in blocks:
            blocks[h] = random_ids(rng_for(cfg.seed, 4, h), block, cfg.vocab_size)
        return blocks[h]

    sessions = []
    for i, row in enumerate(rows):
        hashes = row["hash_ids"]
        # The last block is partial: the input length decides how much of it, within the blocks given.
        n_in = math.ceil(row["input_length"] * cfg.length_scale)
        n_in = min(len(hashes) * block, max((len(hashes) - 1) * block + 1, n_in))
        prompt = [t for h in hashes for t in tokens(h)][:n_in]
        n_out = max(1, round(row["output_length"] * cfg.output_scale))
        arrival = (row["timestamp"] / 1000 - cfg.start_s) * cfg.time_scale
        sessions.append(Session(id=f"trace-{i}", turns=(Turn(render(prompt, cfg.prompt_format), n_out),),
                                arrival_s=arrival))
    return sessions
