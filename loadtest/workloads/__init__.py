"""Workloads: each a config model (pydantic, `kind` names it) and a build() that turns it into
sessions, deterministically from its seed."""
from __future__ import annotations

from typing import Annotated

from pydantic import Field

from loadtest.types import Session
from loadtest.workloads import multi_turn, random, shared_prefix, trace
from loadtest.workloads.multi_turn import MultiTurnWorkload
from loadtest.workloads.random import RandomWorkload
from loadtest.workloads.shared_prefix import SharedPrefixWorkload
from loadtest.workloads.trace import TraceWorkload

WorkloadConfig = Annotated[RandomWorkload | SharedPrefixWorkload | MultiTurnWorkload | TraceWorkload,
                           Field(discriminator="kind")]
KINDS = {"random": random, "shared-prefix": shared_prefix, "multi-turn": multi_turn, "trace": trace}
CONFIGS = {"random": RandomWorkload, "shared-prefix": SharedPrefixWorkload, "multi-turn": MultiTurnWorkload,
           "trace": TraceWorkload}


def build_sessions(cfg: WorkloadConfig) -> list[Session]:
    return KINDS[cfg.kind].build(cfg)


__all__ = ["CONFIGS", "KINDS", "MultiTurnWorkload", "RandomWorkload", "SharedPrefixWorkload", "TraceWorkload",
           "WorkloadConfig", "build_sessions"]
