"""`shared-prefix`: G groups, each a long system prompt shared by Q questions (SGLang's
generated-shared-prefix dataset, same parameter names), optionally several turns per question.

The prefix cache's best case: every question after the first in a group can reuse the group's
system prompt. Questions are interleaved across groups (q0 of every group, then q1, ...) so
consecutive arrivals do not trivially share a prefix.
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from loadtest.types import Session, Turn
from loadtest.workloads.base import WorkloadBase
from loadtest.workloads.tokens import random_ids, render, rng_for


class SharedPrefixWorkload(WorkloadBase):
    kind: Literal["shared-prefix"] = "shared-prefix"
    num_groups: int = Field(4, ge=1)
    prompts_per_group: int = Field(8, ge=1)
    system_prompt_len: int = Field(1024, ge=1)
    question_len: int = Field(64, ge=1)
    output_len: int = Field(64, ge=1)
    num_turns: int = Field(1, ge=1, description="questions per session; later ones resend the history")
    think_time_s: float = Field(0.0, ge=0)


def build(cfg: SharedPrefixWorkload) -> list[Session]:
    systems = [random_ids(rng_for(cfg.seed, 1, g), cfg.system_prompt_len, cfg.vocab_size)
               for g in range(cfg.num_groups)]
    sessions = []
    for q in range(cfg.prompts_per_group):
        for g in range(cfg.num_groups):
            rng = rng_for(cfg.seed, 2, g, q)
            turns = tuple(Turn(render(random_ids(rng, cfg.question_len, cfg.vocab_size), cfg.prompt_format),
                               cfg.output_len) for _ in range(cfg.num_turns))
            sessions.append(Session(id=f"group{g}-q{q}", turns=turns,
                                    system=render(systems[g], cfg.prompt_format), think_time_s=cfg.think_time_s))
    return sessions
