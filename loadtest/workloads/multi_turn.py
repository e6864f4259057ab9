"""`multi-turn`: chat sessions; each turn resends the growing history (previous questions and the
server's own answers) after a think time, the pattern that makes a conversation's KV worth keeping."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from loadtest.types import Session, Turn
from loadtest.workloads.base import LengthSpec, WorkloadBase
from loadtest.workloads.tokens import random_ids, render, rng_for, sample_lengths


class MultiTurnWorkload(WorkloadBase):
    kind: Literal["multi-turn"] = "multi-turn"
    num_sessions: int = Field(8, ge=1)
    num_turns: int = Field(4, ge=1)
    input_len: LengthSpec = Field("64", description="tokens in each new user message")
    output_len: LengthSpec = "64"
    system_prompt_len: int = Field(0, ge=0, description="a system prompt per session (0: none)")
    think_time_s: float = Field(1.0, ge=0, description="pause between an answer and the next question")


def build(cfg: MultiTurnWorkload) -> list[Session]:
    sessions = []
    for s in range(cfg.num_sessions):
        rng = rng_for(cfg.seed, 3, s)
        inputs = sample_lengths(cfg.input_len, cfg.num_turns, rng)
        outputs = sample_lengths(cfg.output_len, cfg.num_turns, rng)
        system = (render(random_ids(rng, cfg.system_prompt_len, cfg.vocab_size), cfg.prompt_format)
                  if cfg.system_prompt_len else None)
        turns = tuple(Turn(render(random_ids(rng, n_in, cfg.vocab_size), cfg.prompt_format), n_out)
                      for n_in, n_out in zip(inputs, outputs))
        sessions.append(Session(id=f"session-{s}", turns=turns, system=system, think_time_s=cfg.think_time_s))
    return sessions
