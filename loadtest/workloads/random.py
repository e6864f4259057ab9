"""`random`: independent prompts of random tokens, lengths from a spec (fixed, uniform, normal, list)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from loadtest.types import Session, Turn
from loadtest.workloads.base import LengthSpec, WorkloadBase
from loadtest.workloads.tokens import random_ids, render, rng_for, sample_lengths


class RandomWorkload(WorkloadBase):
    kind: Literal["random"] = "random"
    num_prompts: int = Field(100, ge=1)
    input_len: LengthSpec = "128"
    output_len: LengthSpec = "128"


def build(cfg: RandomWorkload) -> list[Session]:
    rng = rng_for(cfg.seed, 0)
    inputs = sample_lengths(cfg.input_len, cfg.num_prompts, rng)
    outputs = sample_lengths(cfg.output_len, cfg.num_prompts, rng)
    return [Session(id=f"random-{i}", turns=(Turn(render(random_ids(rng, n_in, cfg.vocab_size), cfg.prompt_format),
                                                  n_out),))
            for i, (n_in, n_out) in enumerate(zip(inputs, outputs))]
