"""The fleet simulator at scale, on the Mooncake conversation trace (docs/SIMULATOR.md).

1. Scale: the whole trace (12,031 requests, one hour) through the real router onto 64
   simulated H200 workers (32 prefill + 32 decode, Qwen3-32B, 512-token blocks so the
   engine's block hashes name exactly the trace's hash ids). Wall time and this process's
   CPU time (the machine is shared: CpuWatch reports the other processes' share too).
2. Routing policies' prefix hit ratio against the trace's ideal (one infinite cache that keeps
   every block, sim/trace.py ideal_hit_ratio): 16 prefill workers (+ 8 decode) whose device
   pools each hold 25% of the trace's unique blocks.
3. TTFT p90 kv_aware / round_robin at 80% load: the trace's timeline compressed until the
   round_robin fleet's prefill workers are 80% busy (estimated from run 2's utilization).

Runs 2 and 3 scale output lengths by OUTPUT_SCALE (TTFT and hits are decided on the prefill
side; decode only adds simulation time). Not measured here, and reported as null: the
calibration errors against measured runs of benchmarks/serving_bench.sh's configurations
(`sim_error_*`; `brigade sim calibrate` is not built yet) and the advisor's measured goodput
ratio (it needs a measured sweep of real configurations).

--quick: the first QUICK_REQUESTS requests of the trace, three policies; writes sim_bench.quick.json.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import CpuWatch, machine_info, print_ratios, write_result  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from sim.fleet import FleetConfig, simulate  # noqa: E402
from sim.trace import from_trace, ideal_hit_ratio, load_trace  # noqa: E402

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake_conversation_trace.jsonl"
OUTPUT_SCALE = 0.125
QUICK_REQUESTS = 600
ROUTER = RouterConfig(health_interval_s=10.0, max_running=100_000, max_waiting=100_000, max_waiting_tokens=10**12)
BASE = FleetConfig(model="Qwen3-32B", device="H200", block_size=512, stream_every=64, router=ROUTER)


# kv_aware_wide: kv_aware with a load-balance guard sized for this fleet (router/policy.py): the
# default 8,192 tokens is less than one of this trace's prompts, so the guard, not the cache,
# decides most picks once any worker has a prompt queued.
VARIANTS = {"kv_aware_wide": {"policy": "kv_aware", "balance_slack_tokens": 65536}}


def _policy(policy: str) -> RouterConfig:
    return ROUTER.model_copy(update=VARIANTS.get(policy, {"policy": policy}))


def _prefill_utilization(run: dict) -> float:
    busy = [w["busy_s"] for wid, w in run["sim"]["workers"].items() if wid.startswith("prefill")]
    return sum(busy) / len(busy) / run["sim"]["virtual_s"]


def scale_run(trace: Path, limit: int | None) -> dict:
    reqs = load_trace(trace, num_prompts=limit)
    cfg = BASE.model_copy(update={"prefill": 32, "decode": 32})
    watch = CpuWatch()
    run = simulate(cfg, from_trace(reqs))
    cpu = watch.stop()
    return {"requests": len(reqs), "completed": run["completed"], "failed": run["failed"], **cpu,
            "virtual_s": run["sim"]["virtual_s"], "p90_ttft_ms": run["p90_ttft_ms"],
            "mean_tpot_ms": run["mean_tpot_ms"], "cache_hit_ratio": run["cache_hit_ratio"],
            "gpus": cfg.gpus}


def hit_ratio_runs(trace: Path, limit: int | None, policies: list[str]) -> tuple[dict, dict]:
    reqs = load_trace(trace, num_prompts=limit, output_scale=OUTPUT_SCALE)
    unique = len({h for r in reqs for h in r.prompt.hash_ids})
    blocks = max(2, unique // 4)
    cfg = BASE.model_copy(update={"prefill": 16, "decode": 8, "num_blocks": blocks})
    runs = {}
    for policy in policies:
        watch = CpuWatch()
        run = simulate(cfg.model_copy(update={"router": _policy(policy)}), from_trace(reqs))
        runs[policy] = {"hit_ratio": run["cache_hit_ratio"], "p90_ttft_ms": run["p90_ttft_ms"],
                        "prefill_utilization": _prefill_utilization(run), "failed": run["failed"], **watch.stop()}
        print(f"  {policy}: hit ratio {run['cache_hit_ratio']:.3f}, p90 TTFT {run['p90_ttft_ms']:.0f} ms, "
              f"prefill busy {runs[policy]['prefill_utilization']:.0%}", flush=True)
    setup = {"requests": len(reqs), "unique_blocks": unique, "blocks_per_worker": blocks,
             "ideal_hit_ratio": ideal_hit_ratio(reqs), "prefill": 16, "decode": 8}
    return setup, runs


def loaded_runs(trace: Path, limit: int | None, rr_utilization: float, blocks: int) -> dict:
    time_scale = rr_utilization / 0.8  # utilization grows as the timeline is compressed
    reqs = load_trace(trace, num_prompts=limit, output_scale=OUTPUT_SCALE, time_scale=time_scale)
    cfg = BASE.model_copy(update={"prefill": 16, "decode": 8, "num_blocks": blocks})
    out = {"time_scale": time_scale}
    for policy in ("kv_aware", "round_robin"):
        run = simulate(cfg.model_copy(update={"router": _policy(policy)}), from_trace(reqs))
        out[policy] = {"p90_ttft_ms": run["p90_ttft_ms"], "mean_ttft_ms": run["mean_ttft_ms"],
                       "hit_ratio": run["cache_hit_ratio"], "prefill_utilization": _prefill_utilization(run),
                       "queue_share_of_ttft": run["sim"]["mean_queue_share_of_ttft"]}
        print(f"  80% load, {policy}: p90 TTFT {run['p90_ttft_ms']:.0f} ms, prefill busy "
              f"{out[policy]['prefill_utilization']:.0%}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"the first {QUICK_REQUESTS} requests, three policies")
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args()
    limit = QUICK_REQUESTS if args.quick else None
    policies = ["kv_aware", "kv_aware_wide", "round_robin"]
    if not args.quick:
        policies += ["least_loaded", "random"]
    machine = machine_info()
    print("scale run: the whole trace on 64 simulated H200 workers" if not args.quick else "scale run (quick)")
    scale = scale_run(args.trace, limit)
    print(f"  {scale['requests']} requests, {scale['virtual_s']:.0f} s simulated in {scale['wall_s']:.1f} s wall, "
          f"{scale['own_cpu_s']:.1f} s CPU", flush=True)
    print("hit ratios: 16 prefill workers, 25% of the unique blocks each")
    setup, hits = hit_ratio_runs(args.trace, limit, policies)
    print("TTFT at 80% load")
    loaded = loaded_runs(args.trace, limit, hits["round_robin"]["prefill_utilization"], setup["blocks_per_worker"])
    ideal = setup["ideal_hit_ratio"]
    ratios = {
        "scale_wall_s": scale["wall_s"],
        "scale_cpu_s": scale["own_cpu_s"],
        "kv_aware_hit_vs_ideal": hits["kv_aware"]["hit_ratio"] / ideal if ideal else None,
        **{f"{p}_hit_vs_ideal": hits[p]["hit_ratio"] / ideal if ideal else None for p in policies if p != "kv_aware"},
        "ttft_p90_kv_aware_vs_round_robin_80pct": (loaded["kv_aware"]["p90_ttft_ms"]
                                                   / loaded["round_robin"]["p90_ttft_ms"]),
        # Not measured in this run (see the docstring): null, and their targets show MISS.
        "sim_error_ttft_p50": None, "sim_error_ttft_p90": None, "sim_error_tpot_mean": None,
        "sim_error_throughput": None, "sim_error_hit_ratio": None, "advisor_goodput_vs_best_measured": None,
    }
    # The wall-time target assumes the 2 cores are ours; on a shared machine the process's own
    # CPU time is the figure other work does not inflate, so it carries the same bound.
    targets = {"scale_wall_s": "< 60", "scale_cpu_s": "< 60", "kv_aware_hit_vs_ideal": ">= 0.95",
               "ttft_p90_kv_aware_vs_round_robin_80pct": "< 1.0",
               **{k: "<= 0.15" for k in ratios if k.startswith("sim_error_")},
               "advisor_goodput_vs_best_measured": ">= 0.95"}
    raw = {"scale": scale, "hit_ratio_setup": setup, "hit_ratios": hits, "loaded_80pct": loaded,
           "output_scale_runs_2_3": OUTPUT_SCALE,
           "not_measured": ["sim_error_* (brigade sim calibrate and the measured serving_bench runs beside it)",
                            "advisor_goodput_vs_best_measured (a measured sweep of >= 4 real configurations)"]}
    print_ratios(ratios, targets, "sim_bench")
    path = write_result("sim_bench.quick" if args.quick else "sim_bench", machine, ratios, targets, raw)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
