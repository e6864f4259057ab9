"""What a simulated run replays: any workload `brigade bench` generates (loadtest/workloads,
with its arrival processes), or a Mooncake trace at full scale (sim/trace.py)."""
from __future__ import annotations

from loadtest.arrivals import arrival_offsets
from loadtest.types import Session
from loadtest.workloads import WorkloadConfig, build_sessions
from sim.fleet import SimSession
from sim.trace import TraceRequest


def from_loadtest(cfg: WorkloadConfig, rate: float, arrival: str = "poisson", burstiness: float = 1.0
                  ) -> list[SimSession]:
    """The workload's sessions at `rate` sessions/s, as `brigade bench run` would send them
    (token-id prompts: the simulator has no tokenizer)."""
    if cfg.prompt_format != "ids":
        raise ValueError("the simulator replays token-id prompts: use --prompt-format ids")
    sessions: list[Session] = build_sessions(cfg)
    offsets = arrival_offsets(sessions, rate, arrival, burstiness, cfg.seed)
    return [SimSession(s.id, off, tuple((t.content, t.output_len) for t in s.turns), s.system, s.think_time_s)
            for s, off in zip(sessions, offsets)]


def from_trace(requests: list[TraceRequest]) -> list[SimSession]:
    return [SimSession(r.request_id, r.arrival_s, ((r.prompt, r.output_len),)) for r in requests]
