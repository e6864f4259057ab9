"""A simulated request's record and a run's summary, with `brigade bench`'s meanings (TPOT
excludes the first token; goodput counts requests meeting every SLO) and field names, so
cluster/sim_bridge.py can hand them to loadtest's report unchanged. sim/ may not import
loadtest (../shared/DESIGN.md), hence these few lines of its own."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class SimRecord:
    """One simulated request; the fields of loadtest.types.RequestRecord (and its migrations). Times in virtual
    seconds: `start_s` since the run began, chunk times since the request was sent."""

    request_id: str
    session_id: str
    turn: int
    start_s: float
    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    error_kind: str | None = None
    error: str | None = None
    migrations: int = 0  # times the router moved it to other workers after one died (not in bench records)

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def max_itl_s(self) -> float:
        return float(np.diff(self.chunk_times_s).max()) if len(self.chunk_times_s) > 1 else 0.0


def meets_slo(r: SimRecord, slo: dict[str, float]) -> bool:
    """Every SLO (seconds per key: ttft, tpot, itl, e2el) met, as loadtest.metrics.meets_slo."""
    if not r.ok:
        return False
    values = {"ttft": r.ttft_s, "tpot": r.tpot_s or 0.0, "e2el": r.e2e_s, "itl": r.max_itl_s}
    return all(values[k] is not None and values[k] <= limit for k, limit in slo.items())


def summarize(records: list[SimRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    done = [r for r in records if r.ok]
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    n_in = sum(r.prompt_tokens for r in done)
    out = {"completed": len(done), "failed": len(records) - len(done),
           "request_throughput": len(done) * per_s,
           "request_goodput": sum(meets_slo(r, slo) for r in done) * per_s if slo else None,
           "output_throughput": sum(r.output_tokens for r in done) * per_s,
           "cache_hit_ratio": sum(r.cached_tokens for r in done) / n_in if n_in else 0.0}
    for name, values in (("ttft", [r.ttft_s for r in done if r.ttft_s is not None]),
                         ("tpot", [t for r in done if (t := r.tpot_s) is not None])):
        ms = np.asarray(values, dtype=float) * 1000
        out[f"mean_{name}_ms"] = float(ms.mean()) if ms.size else None
        for p in (50, 90, 99):
            out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p)) if ms.size else None
    return out
