"""When each session starts (open loop), as offsets in seconds from the start of the run.

`poisson` with burstiness 1 is a Poisson process; other burstiness values draw gamma
inter-arrival times with the same mean rate (shape = burstiness: < 1 burstier, > 1 smoother),
as `vllm bench serve` does. `fixed` spaces arrivals evenly. `trace` uses each session's own
timestamp. An infinite rate sends everything at once; `max_concurrency` then makes it a
closed loop (the runner keeps that many requests in flight).
"""
from __future__ import annotations

import math
from typing import Literal

import numpy as np

from loadtest.types import Session

Process = Literal["poisson", "fixed", "trace"]


def arrival_offsets(sessions: list[Session], rate: float, process: Process, burstiness: float,
                    seed: int) -> list[float]:
    """One start offset per session, non-decreasing."""
    n = len(sessions)
    if process == "trace":
        missing = [s.id for s in sessions if s.arrival_s is None]
        if missing:
            raise ValueError(f"arrival 'trace' needs timestamps, and session {missing[0]} has none; "
                             "use the trace workload or another --arrival")
        return [s.arrival_s for s in sessions]
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if process == "fixed":
        return [i / rate for i in range(n)]
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    gaps = np.random.default_rng([seed, 5]).gamma(shape=burstiness, scale=1 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first request starts the run
    return np.cumsum(gaps).tolist()
