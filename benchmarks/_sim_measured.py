"""sim_bench's measured part: the simulator's predictions against real runs on this machine,
in the same benchmark run (benchmarks/_sim_validate.py has the pieces).

1. Calibrate: `brigade sim calibrate` fits the "this machine" profile (one torch thread: every
   real worker below gets one, `--num-cpus` = its worker count) in the dtype the workers run
   (auto), then `--serving-only` measures the serving path's costs beyond the engine's steps
   (per request: door, router, actor calls; per streamed token) on a 1-worker colocated and a
   1P+1D `brigade serve`, with short completions of their own: none of the requests validated
   below.
2. Validation: serving_bench.sh's two configurations (1 prefill + 1 decode, 2 colocated) at
   1, 2 and 4 req/s of its shared-prefix workload (smaller: a short quiet run), and a
   shared-prefix routing run on 2 prefill workers + 1 decode (kv_aware over the real Redis
   index): each measured with `brigade bench run` against `brigade serve`, each simulated with
   the same fleet, requests and arrival times, on the serving path's costs of step 1 and the
   mean of two engine fits taken on the running fleet just before and just after its
   measured runs (this machine's speed drifts by tens of percent within minutes: other
   tenants; one fit at the start predicted the last fleets 30-40% fast; runs under which the
   two fits moved by more than MAX_DRIFT are measured again). `sim_error_<figure>`
   is the largest relative error over those runs, for p50 and p90 TTFT, mean TPOT, request
   throughput and the prefix hit ratio.
3. Advisor: `brigade plan` (simulated, on the calibrated profile) picks the cheapest fleet of
   at most 3 workers whose requests meet ADVISOR_SLO at 90% under a bursty load (gamma
   arrivals, burstiness 0.25); that load is then measured on a sweep of 4 real fleets (and on
   the recommended one if it is not among them). `advisor_goodput_vs_best_measured` = the
   recommended fleet's measured goodput / the sweep's best.

The model is the `bench` preset (random weights, no download): SmolLM2-135M, the serving
default, costs ~4x its prefill and decode time here, so the same sweep would not fit the
10-minute budget, and the simulator's question (does the roofline with this machine's fitted
profile predict the real scheduler's queueing) does not depend on the weights' values.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from _sim_validate import (
    Fleet,
    Load,
    bench,
    calibrate,
    calibrate_here,
    engine_drift,
    engine_fit_around,
    errors,
    fleet_config,
    serve,
    simulate_load,
    ttft_samples,
)

MODEL = "bench"
NUM_BLOCKS = 1024
SLO = "ttft=2s,tpot=200ms"
# 32 requests a run: with 16, a run's p50 TTFT fell between two of its hits and moved with
# either (the run-to-run spread of one fleet's p50 was 0.07-0.43 of it).
LOAD = Load(rates=(1.0, 2.0, 4.0), num_groups=4, prompts_per_group=8, system_prompt_len=512, question_len=32,
            output_len=32)
ROUTING_LOAD = Load(rates=(2.0,), num_groups=4, prompts_per_group=8, system_prompt_len=1024, question_len=32,
                    output_len=16, seed=100)
# A validated fleet whose engine fits before and after its runs differ by more than this is
# measured again (at most MEASURE_TRIES times; the steadiest try counts).
MAX_DRIFT = 0.2
MEASURE_TRIES = 2
ADVISOR_SLO = "ttft=1500ms,tpot=150ms"
ADVISOR_LOAD = Load(rates=(3.0,), num_groups=2, prompts_per_group=12, system_prompt_len=512, question_len=256,
                    output_len=32, burstiness=0.25, seed=200)
ONE_P_ONE_D = Fleet("1p1d", "disaggregated", prefill=1, decode=1)
TWO_MIXED = Fleet("2mixed", "colocated", workers_colocated=2)
TWO_P_ONE_D = Fleet("2p1d", "disaggregated", prefill=2, decode=1)
ONE_MIXED = Fleet("1mixed", "colocated", workers_colocated=1)
VALIDATION = ((ONE_P_ONE_D, LOAD), (TWO_MIXED, LOAD), (TWO_P_ONE_D, ROUTING_LOAD))
ADVISOR_SWEEP = (ONE_MIXED, TWO_MIXED, ONE_P_ONE_D, TWO_P_ONE_D)
# --quick: one fleet, one rate, a handful of requests: checks the machinery, not the model.
QUICK_LOAD = Load(rates=(2.0,), num_groups=2, prompts_per_group=2, system_prompt_len=128, question_len=16,
                  output_len=8)


def _fleet_of(rec: dict) -> Fleet:
    if rec["mode"] == "colocated":
        return Fleet(f"{rec['prefill']}mixed", "colocated", workers_colocated=rec["prefill"])
    return Fleet(f"{rec['prefill']}p{rec['decode']}d", "disaggregated", prefill=rec["prefill"], decode=rec["decode"])


def advise(profile: Path) -> dict:
    """`brigade plan`'s search for ADVISOR_LOAD on the calibrated profile (fleets of <= 3 workers)."""
    from cluster.sim_bridge import from_loadtest
    from loadtest.metrics import parse_slo
    from sim.plan import PlanConfig, plan

    base = fleet_config(ONE_P_ONE_D, MODEL, profile, NUM_BLOCKS)
    cfg = PlanConfig(base=base, slo=parse_slo(ADVISOR_SLO), goodput=0.9, max_gpus=3, tp_sizes=(1,),
                     policies=("kv_aware",))
    sessions = from_loadtest(ADVISOR_LOAD.workload(0), ADVISOR_LOAD.rates[0], burstiness=ADVISOR_LOAD.burstiness)
    return plan(cfg, sessions)


def run(out_dir: Path, quick: bool, parts: set[str]) -> tuple[dict, dict]:
    """Ratios (sim_error_*, advisor_goodput_vs_best_measured; None where not run) and raw."""
    from loadtest.metrics import parse_slo

    out_dir.mkdir(parents=True, exist_ok=True)
    profile_path = out_dir / "this-machine.json"
    profile = calibrate_here(MODEL, NUM_BLOCKS, profile_path, out_dir / "logs" / "calibrate")
    raw: dict = {"model": MODEL, "num_blocks": NUM_BLOCKS, "profile": profile}
    validation = ((ONE_P_ONE_D, QUICK_LOAD),) if quick else VALIDATION
    jobs: dict[Fleet, list[tuple[str, Load, str]]] = {}
    if "validate" in parts:
        for fleet, load in validation:
            jobs.setdefault(fleet, []).append(("validate", load, SLO))
    recommended = None
    if "advisor" in parts:
        advice = advise(profile_path)
        raw["advisor_plan"] = advice
        recommended = _fleet_of(advice["recommended"]) if advice["recommended"] else None
        print(f"  brigade plan recommends {recommended.name if recommended else 'nothing'}", flush=True)
        for fleet in dict.fromkeys([*ADVISOR_SWEEP, *([recommended] if recommended else [])]):
            jobs.setdefault(fleet, []).append(("advisor", ADVISOR_LOAD, ADVISOR_SLO))
    measured: dict[tuple[str, str], list[dict]] = {}
    raw["failed_fleets"] = {}
    profiles: dict[str, Path] = {}  # a validated fleet's profile: the engine fitted around its run
    for fleet, todo in jobs.items():
        print(f"  brigade serve {fleet.name} ({' '.join(fleet.serve_flags())})", flush=True)
        validated = any(kind == "validate" for kind, _, _ in todo)
        try:  # one fleet that will not start (a loaded machine's Ray bootstrap) leaves the others' figures
            with serve(fleet, MODEL, NUM_BLOCKS, out_dir / "logs") as url:
                if not validated:
                    for kind, load, slo in todo:
                        measured[(fleet.name, kind)] = bench(url, load, slo, out_dir / f"{fleet.name}-{kind}",
                                                             fleet.name)
                    continue
                # The machine's speed drifts by tens of percent within minutes: the engine is fitted
                # just before and just after the runs, and runs it moved under by more than
                # MAX_DRIFT are measured again (the engine fits then cannot say what they ran on).
                before = calibrate(MODEL, 1, out_dir / f"{fleet.name}-before.json")
                tries = []
                for attempt in range(1, MEASURE_TRIES + 1):
                    runs = {kind: bench(url, load, slo, out_dir / f"{fleet.name}-{kind}-{attempt}", fleet.name)
                            for kind, load, slo in todo}
                    after = calibrate(MODEL, 1, out_dir / f"{fleet.name}-after-{attempt}.json")
                    drift = engine_drift(MODEL, before, after)
                    tries.append((drift, runs, before, after))
                    print(f"  {fleet.name}: the engine's steps moved {drift:.0%} during its runs", flush=True)
                    if drift <= MAX_DRIFT:
                        break
                    before = after
                _, runs, before, after = min(tries, key=lambda t: t[0])
                raw.setdefault("engine_drift", {})[fleet.name] = [t[0] for t in tries]
                measured.update({(fleet.name, kind): r for kind, r in runs.items()})
                profiles[fleet.name] = out_dir / f"{fleet.name}-profile.json"
                profiles[fleet.name].write_text(json.dumps(engine_fit_around(before, after, profile), indent=1))
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            raw["failed_fleets"][fleet.name] = str(exc)
            print(f"  {fleet.name} failed: {exc}", flush=True)
    ratios: dict = {f"sim_error_{k}": None for k in ("ttft_p50", "ttft_p90", "tpot_mean", "throughput", "hit_ratio")}
    ratios["advisor_goodput_vs_best_measured"] = None
    if "validate" in parts:
        runs = []
        for fleet, load in validation:
            if (fleet.name, "validate") not in measured or fleet.name not in profiles:
                continue
            sims = simulate_load(fleet, load, MODEL, profiles[fleet.name], NUM_BLOCKS, parse_slo(SLO))
            raw.setdefault("fleet_profiles", {})[fleet.name] = json.loads(profiles[fleet.name].read_text())
            for m, s in zip(measured[(fleet.name, "validate")], sims):
                runs.append({"fleet": fleet.name, "rate": s["request_rate"], "errors": errors(m, s),
                             "measured": _figures(m), "simulated": _figures(s),
                             "ttft_ms": {"measured": ttft_samples(m), "simulated": ttft_samples(s)}})
        for key in ratios:
            if key.startswith("sim_error_"):
                vals = [r["errors"][key.removeprefix("sim_error_")] for r in runs]
                vals = [v for v in vals if v is not None]
                ratios[key] = max(vals) if vals else None
        raw["validation"] = runs
    if "advisor" in parts:
        goodput = {name: runs[0]["request_goodput"] or 0.0 for (name, kind), runs in measured.items()
                   if kind == "advisor"}
        sweep = {f.name: goodput[f.name] for f in ADVISOR_SWEEP if f.name in goodput}
        best = max(sweep.values(), default=0.0)
        # The ratio needs the recommended fleet and the whole sweep measured.
        if recommended is not None and recommended.name in goodput and len(sweep) == len(ADVISOR_SWEEP) and best > 0:
            ratios["advisor_goodput_vs_best_measured"] = goodput[recommended.name] / best
        raw["advisor_measured_goodput"] = goodput
        raw["advisor_recommended"] = recommended.name if recommended else None
    return ratios, raw


def _figures(run: dict) -> dict:
    return {k: run.get(k) for k in ("p50_ttft_ms", "p90_ttft_ms", "mean_tpot_ms", "request_throughput",
                                    "cache_hit_ratio", "request_goodput", "completed", "failed")}


def plot(runs: list[dict], name: str) -> Path | None:
    """Predicted against measured TTFT distributions (CDFs), one panel per fleet, a colour per rate."""
    import _common as C

    fleets = list(dict.fromkeys(r["fleet"] for r in runs))
    if not fleets:
        return None
    fig, axes = C.new_figure(len(fleets), "TTFT: measured (solid), simulated (dashed)")
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red"]
    for ax, fleet in zip(axes, fleets):
        for i, r in enumerate(x for x in runs if x["fleet"] == fleet):
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
