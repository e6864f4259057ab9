"""A simulated request's record and a run's summary, with `brigade bench`'s meanings (TPOT
excludes the first token; goodput counts requests meeting every SLO) and field names, so
cluster/sim_bridge.py can hand them to loadtest's report unchanged. The record and the SLO
check are loadtest's (loadtest/records.py, the one module of loadtest sim/ imports)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loadtest.records import RequestRecord, meets_slo

__all__ = ["SimRecord", "meets_slo", "summarize"]


@dataclass
class SimRecord(RequestRecord):
    """One simulated request: loadtest's per-request record (times in virtual seconds) and how
    often the router moved it to other workers after one died (not in bench records)."""

    migrations: int = 0


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
