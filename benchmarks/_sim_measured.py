"""sim_bench's measured part: the simulator's predictions against real runs on this machine.

Stored tries (benchmarks/results/sim_measured.json, written by `--measure`): each validated
point (a fleet at a rate of its load) measured REPEATS times with `brigade bench run` against
`brigade serve`, each try with its own prompts (the load's seed + the try's offset: the serve's
prefix cache still holds the last try's), the device fitted around it (the mean of
`brigade sim calibrate` just before and just after: this machine's speed drifts within
minutes) and this machine's serving terms (benchmarks/_sim_validate.py's serving_probe).
The advisor's load is measured once on each fleet of ADVISOR_SWEEP, first on its fresh serve.

Validation (every run, no serve): each stored try re-simulated with its own prompts, device
and serving terms on its twin (_sim_validate.simulate_twin); for each point and figure, the
error in units of the measured run-to-run spread: |mean of the simulated tries - mean of the
measured ones| / the measured tries' standard deviation (_sim_validate.spread_errors).
`sim_spread_<figure>` is the largest over the points.

Advisor: `brigade plan` (the product simulator, a device of each worker's own, on the stored
calibration's device, headroom ADVISOR_HEADROOM) picks the cheapest fleet of at most 3 workers
meeting ADVISOR_SLO for 90% of requests under a bursty load; `advisor_goodput_vs_best_measured`
is that fleet's measured goodput over the sweep's best.

The model is the `bench` preset (random weights, no download): the question (do the roofline
and the real scheduler and router predict the queueing) does not depend on the weights' values.
"""
from __future__ import annotations

import json
import subprocess
from dataclasses import replace
from pathlib import Path

from benchmarks import _sim_validate as V

MODEL = "bench"
NUM_BLOCKS = 1024
SLO = "ttft=2s,tpot=200ms"
STORED = Path(__file__).resolve().parent / "results" / "sim_measured.json"
LOADS = {  # 32 requests a run
    "shared_prefix": V.Load(rates=(1.0, 2.0, 4.0), num_groups=4, prompts_per_group=8, system_prompt_len=512,
                            question_len=32, output_len=32),
    "routing": V.Load(rates=(2.0,), num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=32,
                      output_len=16, seed=100),
}
VALIDATION = (("1p1d", "shared_prefix"), ("2mixed", "shared_prefix"), ("2p1d", "routing"))
REPEATS = 5
TRY_SEED_STRIDE = 1000
ADVISOR_SLO = "ttft=1500ms,tpot=150ms"
ADVISOR_HEADROOM = 1.2
ADVISOR_LOAD = V.Load(rates=(3.0,), num_groups=2, prompts_per_group=12, system_prompt_len=512, question_len=256,
                      output_len=32, burstiness=0.25, seed=200)
ADVISOR_SWEEP = ("1mixed", "2mixed", "1p1d", "2p1d")
# --measure --quick: one fleet, one rate, 3 tries of a handful of requests: checks the machinery.
QUICK_LOAD = V.Load(rates=(2.0,), num_groups=2, prompts_per_group=2, system_prompt_len=128, question_len=16,
                    output_len=8)


def _slo(text: str) -> dict:
    from loadtest.metrics import parse_slo

    return parse_slo(text)


def validate(stored: dict) -> tuple[dict, list[dict]]:
    """Every stored point's tries re-simulated: sim_spread_* ratios and one row per point."""
    slo, cores = _slo(SLO), stored["host_cores"]
    rows = []
    for point in stored["points"]:
        fleet, load = V.fleet_named(point["fleet"]), _load(stored, point["load"])
        sims = [V.simulate_twin(fleet, stored["model"], stored["num_blocks"], t["device"], t["serving"], cores,
                                load.sessions(point["rate_index"], t["seed_offset"]), slo)
                for t in point["tries"]]
        measured = [t["measured"] for t in point["tries"]]
        rows.append({"fleet": point["fleet"], "rate": point["rate"], "tries": len(measured),
                     "errors": V.spread_errors(measured, [V.figures(s) for s in sims]),
                     "simulated_tries": [V.figures(s) for s in sims],
                     "ttft_ms": {"measured": point.get("ttft_ms", []),
                                 "simulated": sorted(t for s in sims for t in V.ttft_samples(s))}})
    ratios = {}
    for key in V.METRICS:
        vals = [r["errors"][key]["spreads"] for r in rows if r["errors"].get(key)]
        ratios[f"sim_spread_{key}"] = max(vals) if vals else None
    return ratios, rows


def _load(stored: dict, name: str) -> V.Load:
    return V.Load(**stored["loads"][name]) if "loads" in stored else LOADS[name]


def advise(stored: dict) -> tuple[float | None, dict]:
    """`brigade plan`'s pick for ADVISOR_LOAD on the stored calibration's device, and its
    measured goodput over the best of the stored sweep."""
    import tempfile

    from engine.config import CacheConfig, SchedulerConfig
    from router.config import RouterConfig
    from sim.fleet import FleetConfig
    from sim.plan import PlanConfig, plan

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(stored["calibration"]["device"], f)
    try:
        base = FleetConfig(model=stored["model"], device=f.name, link="gloo-loopback",
                           block_size=CacheConfig().block_size, num_blocks=stored["num_blocks"],
                           scheduler=SchedulerConfig(), stream_every=1, router=RouterConfig(policy="kv_aware"))
        cfg = PlanConfig(base=base, slo=_slo(ADVISOR_SLO), goodput=0.9, headroom=ADVISOR_HEADROOM, max_gpus=3,
                         tp_sizes=(1,), policies=("kv_aware",))
        advice = plan(cfg, ADVISOR_LOAD.sessions(0))
    finally:
        Path(f.name).unlink(missing_ok=True)
    answer = "recommended" if advice["recommended"] else "closest"
    pick = advice[answer]
    name = None if pick is None else (f"{pick['prefill']}mixed" if pick["mode"] == "colocated"
                                      else f"{pick['prefill']}p{pick['decode']}d")
    goodput = stored["advisor"]["measured_goodput"]
    best = max((goodput[f] for f in ADVISOR_SWEEP if f in goodput), default=0.0)
    ratio = goodput[name] / best if name in goodput and best > 0 else None
    return ratio, {"answer": answer, "pick": name, "measured_goodput": goodput,
                   "tried": [{k: t[k] for k in ("mode", "prefill", "decode", "slo_met", "headroom_met", "meets")}
                             for t in advice["tried"]]}


# -- recording the tries ------------------------------------------------------------------------
def measure(out_dir: Path, quick: bool, stored_path: Path) -> dict:
    """Serve and measure every point REPEATS times (quick: one small point, 3 tries), the
    advisor's sweep once each (not when quick); write the stored tries to `stored_path`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    loads = {"quick": QUICK_LOAD} if quick else LOADS
    validation = (("1p1d", "quick"),) if quick else VALIDATION
    repeats = 3 if quick else REPEATS
    print("calibrating this machine (brigade sim calibrate, 1 torch thread)", flush=True)
    device = V.calibrate(MODEL, out_dir / "this-machine.json")
    serving = {}
    for name in ("1mixed", "1p1d"):  # the serving terms, on serves of their own
        fleet = V.fleet_named(name)
        with V.serve(fleet, MODEL, NUM_BLOCKS, out_dir / "logs") as url:
            serving.update(V.serving_probe(url, device, MODEL, fleet.mode == "disaggregated"))
    print(f"  serving terms: {', '.join(f'{k} {v * 1000:.2f} ms' for k, v in serving.items())}", flush=True)
    doc: dict = {"about": "measured tries of real `brigade serve` fleets on this machine (sim_bench --measure)",
                 "model": MODEL, "num_blocks": NUM_BLOCKS, "host_cores": float(_cores()),
                 "loads": {k: vars(v) | {"rates": list(v.rates)} for k, v in loads.items()},
                 "calibration": {"device": device, "serving": serving}, "points": [],
                 "advisor": {"measured_goodput": {}}}
    for name, load_name in validation:
        doc["points"] += _measure_fleet(V.fleet_named(name), load_name, loads[load_name], repeats, serving, out_dir)
    if not quick:
        for name in ADVISOR_SWEEP:
            try:
                with V.serve(V.fleet_named(name), MODEL, NUM_BLOCKS, out_dir / "logs") as url:
                    runs = V.bench(url, ADVISOR_LOAD, ADVISOR_SLO, out_dir / f"{name}-advisor", name)
                doc["advisor"]["measured_goodput"][name] = runs[0]["request_goodput"] or 0.0
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                print(f"  {name} failed: {exc}", flush=True)
    stored_path.write_text(json.dumps(doc, indent=1))
    return doc


def _measure_fleet(fleet: V.Fleet, load_name: str, load: V.Load, repeats: int, serving: dict,
                   out_dir: Path) -> list[dict]:
    """One fleet's points (one per rate), each with `repeats` tries."""
    print(f"  brigade serve {fleet.name} ({' '.join(fleet.serve_flags())})", flush=True)
    points = [{"fleet": fleet.name, "load": load_name, "rate": r, "rate_index": i, "tries": [], "ttft_ms": []}
              for i, r in enumerate(load.rates)]
    with V.serve(fleet, MODEL, NUM_BLOCKS, out_dir / "logs") as url:
        before = V.calibrate(MODEL, out_dir / f"{fleet.name}-fit-0.json")
        for k in range(repeats):
            offset = TRY_SEED_STRIDE * k
            runs = V.bench(url, replace(load, seed=load.seed + offset), SLO, out_dir / f"{fleet.name}-{k}", fleet.name)
            after = V.calibrate(MODEL, out_dir / f"{fleet.name}-fit-{k + 1}.json")
            print(f"  {fleet.name} try {k + 1}: the engine's steps moved {V.engine_drift(MODEL, before, after):.0%} "
                  "during it", flush=True)
            for point, run in zip(points, runs):
                point["tries"].append({"seed_offset": offset, "device": V.mean_fit(before, after), "serving": serving,
                                       "measured": V.figures(run)})
                point["ttft_ms"] += V.ttft_samples(run)
            before = after
    for point in points:
        point["ttft_ms"].sort()
    return points


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def plot(rows: list[dict], name: str) -> Path | None:
    """Predicted against measured TTFT distributions (CDFs), one panel per fleet, a colour per rate."""
    from benchmarks import _common as C

    fleets = list(dict.fromkeys(r["fleet"] for r in rows))
    if not fleets:
        return None
    fig, axes = C.new_figure(len(fleets), "TTFT: measured tries (solid), simulated (dashed)")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for ax, fleet in zip(axes, fleets):
        for i, r in enumerate(x for x in rows if x["fleet"] == fleet):
            for kind, style in (("measured", "-"), ("simulated", "--")):
                xs = r["ttft_ms"][kind]
                if xs:
                    ax.plot(xs, [(j + 1) / len(xs) for j in range(len(xs))], style, color=colors[i % 4],
                            label=f"{r['rate']:g} req/s {kind}")
        ax.set_title(fleet, fontsize=10)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("share of requests")
        ax.legend(fontsize=7)
    return C.save_figure(fig, name)
