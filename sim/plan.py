"""`brigade plan`: the cheapest fleet that meets an SLO, found by simulating candidates.

Candidates are disaggregated P:D splits and colocated fleets over TP sizes, tried in order
of GPUs (the cost), each under the routing policies asked for. Every candidate replays the
same workload, with its real arrival process: a bursty load queues in the simulation, so a
fleet sized for the mean rate fails the SLO and the search moves on to one sized for the
bursts. The answer reports each candidate's queue-time share of TTFT, which is what a
planner that ignores queueing cannot see.

A headroom above 1 sizes with a margin: each candidate is simulated again on the device
with every cost that many times its profile's, and a request counts only if it meets the SLO
there. Near its capacity a fleet's queues grow much faster than its steps, so a margin on the
costs finds the fleet that a slower moment, a prediction 20% low or a burst the workload did
not show tips over; dividing the SLO by the same factor does not (a queue's cliff is not a
latency's margin).
"""
from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from sim.cost import Roofline
from sim.fleet import FleetConfig, SimSession, simulate
from sim.hardware import load_device, load_link
from sim.metrics import meets_slo
from sim.shapes import load_shape


class PlanConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    base: FleetConfig = FleetConfig()  # model, device, block size, scheduler, router settings
    slo: dict[str, float]  # seconds per key: ttft, tpot, itl, e2el (loadtest.metrics)
    goodput: float = Field(0.9, gt=0, le=1)  # share of requests that must meet every SLO
    headroom: float = Field(1.0, ge=1)  # a request counts if it meets the SLO with every device cost times this
    max_gpus: int = Field(16, ge=1)
    tp_sizes: tuple[int, ...] = (1, 2, 4, 8)
    policies: tuple[str, ...] = ("kv_aware", "round_robin")
    modes: tuple[str, ...] = ("disaggregated", "colocated")


def _fits(base: FleetConfig, tp: int) -> bool:
    shape, device = load_shape(base.model), load_device(base.device)
    try:
        Roofline(shape, device, tp, load_link(device.intra_link) if tp > 1 else None).kv_capacity_tokens()
    except ValueError:
        return False
    return True


def candidates(cfg: PlanConfig) -> Iterator[tuple[int, dict]]:
    """(GPUs, fleet fields) in order of GPUs, smallest TP first at each size."""
    tps = [tp for tp in cfg.tp_sizes if _fits(cfg.base, tp)]
    out = []
    for tp_p in tps:
        for tp_d in tps:
            for p in range(1, cfg.max_gpus // tp_p + 1):
                for d in range(1, (cfg.max_gpus - p * tp_p) // tp_d + 1):
                    if "disaggregated" in cfg.modes:
                        out.append((p * tp_p + d * tp_d, max(tp_p, tp_d),
                                    {"mode": "disaggregated", "prefill": p, "decode": d,
                                     "prefill_tp": tp_p, "decode_tp": tp_d}))
    if "colocated" in cfg.modes:
        for tp in tps:
            for n in range(1, cfg.max_gpus // tp + 1):
                out.append((n * tp, tp, {"mode": "colocated", "prefill": n, "decode": 0, "prefill_tp": tp,
                                         "decode_tp": tp}))
    out.sort(key=lambda c: (c[0], c[1], c[2]["mode"], c[2]["prefill"]))
    for gpus, _, fields in out:
        yield gpus, fields


def evaluate(cfg: PlanConfig, fleet: FleetConfig, sessions: list[SimSession]) -> dict:
    """One candidate simulated on the profile (its figures and `slo_met`) and, with a headroom,
    again with every device cost times it (`headroom_met`, what `meets` goes by)."""
    def share(run: dict) -> float:
        recs = run["records"]
        return sum(meets_slo(r, cfg.slo) for r in recs) / len(recs) if recs else 0.0

    run = simulate(fleet, sessions, cfg.slo)
    met = share(run)
    within = met if cfg.headroom == 1 else share(
        simulate(fleet.model_copy(update={"slowdown": fleet.slowdown * cfg.headroom}), sessions, cfg.slo))
    return {"mode": fleet.mode, "prefill": fleet.prefill, "decode": fleet.decode, "prefill_tp": fleet.prefill_tp,
            "decode_tp": fleet.decode_tp, "policy": fleet.router.policy, "gpus": fleet.gpus, "slo_met": met,
            "headroom_met": within,
            "request_goodput": run["request_goodput"], "request_throughput": run["request_throughput"],
            "p90_ttft_ms": run["p90_ttft_ms"], "mean_tpot_ms": run["mean_tpot_ms"],
            "queue_share_of_ttft": run["sim"]["mean_queue_share_of_ttft"], "p90_queue_ms": run["sim"]["p90_queue_ms"],
            "cache_hit_ratio": run["cache_hit_ratio"], "meets": within >= cfg.goodput}


def plan(cfg: PlanConfig, sessions: list[SimSession], on_try=None) -> dict:
    """Simulate candidates from the cheapest up; the first size with a candidate meeting the
    SLO (within the headroom) decides, and its best goodput among them is recommended. When
    none meets it, `closest` is the candidate whose requests meet it (within the headroom)
    most often, the cheapest of equals: what to deploy within the budget, and how far it falls
    short (None when one meets)."""
    tried: list[dict] = []
    best, size = None, None
    for gpus, fields in candidates(cfg):
        if size is not None and gpus > size:
            break
        for policy in cfg.policies:
            router = cfg.base.router.model_copy(update={"policy": policy})
            result = evaluate(cfg, cfg.base.model_copy(update={**fields, "router": router}), sessions)
            tried.append(result)
            if on_try is not None:
                on_try(result)
            if result["meets"]:
                size = gpus
                if best is None or result["headroom_met"] > best["headroom_met"]:
                    best = result
    arrivals = sorted(s.arrival_s for s in sessions)
    # `tried` runs cheapest first and max() keeps the first of equals
    closest = max(tried, key=lambda r: r["headroom_met"]) if best is None and tried else None
    return {"recommended": best, "closest": closest, "tried": tried, "slo": {k: v * 1000 for k, v in cfg.slo.items()},
            "goodput": cfg.goodput, "headroom": cfg.headroom, "burst": _burst(arrivals)}


def _burst(arrivals: list[float], window_s: float = 10.0) -> dict:
    """The mean arrival rate and the busiest `window_s` window's: what the fleet must absorb."""
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return {"mean_rate": None, "peak_rate": None, "window_s": window_s}
    j, peak = 0, 0
    for i, t in enumerate(arrivals):
        while arrivals[j] < t - window_s:
            j += 1
        peak = max(peak, i - j + 1)
    span = arrivals[-1] - arrivals[0]
    return {"mean_rate": (len(arrivals) - 1) / span, "peak_rate": peak / min(window_s, span), "window_s": window_s}
