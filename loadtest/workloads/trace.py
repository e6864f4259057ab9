"""`trace`: replay a Mooncake-format trace (the format and its scaling: loadtest/records.py).
Each hash id becomes a deterministic block of random tokens (a function of the seed and the
id), which keeps the trace's prefix sharing at the token level.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from loadtest.records import TraceRow, read_trace
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


def build(cfg: TraceWorkload) -> list[Session]:
    rows = read_trace(cfg.path, cfg.block_size, cfg.length_scale, cfg.output_scale, cfg.time_scale,
                      cfg.num_prompts, cfg.start_s, cfg.window_s)
    blocks: dict[int, list[int]] = {}

    def tokens(h: int, block: int) -> list[int]:
        if h not in blocks:
            blocks[h] = random_ids(rng_for(cfg.seed, 4, h), block, cfg.vocab_size)
        return blocks[h]

    def session(row: TraceRow) -> Session:
        prompt = [t for h in row.hash_ids for t in tokens(h, row.block)][:row.input_len]
        return Session(id=f"trace-{row.index}", turns=(Turn(render(prompt, cfg.prompt_format), row.output_len),),
                       arrival_s=row.arrival_s)

    return [session(row) for row in rows]
