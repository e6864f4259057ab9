"""`brigade sim` (run, calibrate) and `brigade plan`: the flags, the flags -> FleetConfig
mapping, and the commands. cluster/cli.py only mounts add_parsers(); bad flags leave as
ValueError (one line, exit 2), as for every brigade command."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SIM_EPILOG = """\
What is real and what is modelled: the router (admission, routing policy, migration, the
prefix-index view over an in-memory index) and each worker's scheduler, block pool and prefix
cache are Brigade's own code; the model forward is a roofline of the model's shapes on the
device profile, and a KV transfer costs bytes / link bandwidth + latency. Time is virtual:
an hour of traffic replays in seconds, the same seed gives the same result. docs/SIMULATOR.md.

examples:
  brigade sim run --model Qwen3-32B --device H200 --prefill 4 --decode 4 \\
      --workload trace --trace-file mooncake_conversation_trace.jsonl --block-size 512
  brigade sim run --model Llama-3-70B --device H100-SXM --prefill-tp 2 --decode-tp 4 --prefill 2 --decode 1 \\
      --workload shared-prefix --workload-args num_groups=16,prompts_per_group=32 --request-rate 8
  brigade sim run --mode colocated --prefill 8 --decode 0 --policy round_robin --workload random \\
      --workload-args input_len=2048,output_len=256,num_prompts=2000 --request-rate 20 --burstiness 0.25
  brigade bench compare sim-results/result.json bench-results/result.json   # simulated vs measured
"""
PLAN_EPILOG = """\
Candidates (disaggregated P:D splits and colocated fleets, over --tp-sizes, under each
--policies) are simulated in order of GPUs; the first size where one meets the SLO for
--goodput of the requests wins, and among them the one with the most requests meeting it.
Arrivals keep their process (--burstiness < 1: bursty), so queueing shows: each candidate's
queue-time share of TTFT is printed, and the burst (the busiest 10 s window's rate) beside
the mean rate. When none up to --max-gpus meets it, the closest (most requests meeting the
SLO, cheapest of equals) is named, and the command exits 1. --headroom 1.2 sizes with a
margin: each candidate is simulated again with every device cost 1.2x its profile's, and a
request counts only if it meets the SLO there (room for the simulator's error against real
runs, docs/SIMULATOR.md, a slower machine, and bursts the workload lacks: near its capacity
a fleet's queues grow far faster than its costs).

examples:
  brigade plan --model Qwen3-32B --device H200 --slo ttft=2s,tpot=50ms --workload random \\
      --workload-args input_len=4096,output_len=256,num_prompts=1000 --request-rate 6 --burstiness 0.25
  brigade plan --model Qwen3-30B-A3B --device H20 --slo ttft=3s,tpot=80ms --max-gpus 8 \\
      --workload trace --trace-file trace.jsonl --num-prompts 2000 --block-size 512
"""


def _add_fleet(p: argparse.ArgumentParser, counts: bool = True) -> None:
    from sim.hardware import device_names
    from sim.shapes import model_names

    f = p.add_argument_group("fleet")
    f.add_argument("--model", default="Qwen3-32B",
                   help=f"a config.json, a model directory, one of {', '.join(model_names())}, or an engine preset")
    f.add_argument("--device", default="H200",
                   help=f"one of {', '.join(device_names())}, or a profile JSON from `brigade sim calibrate`")
    if counts:
        f.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
        f.add_argument("--prefill", type=int, default=1, help="prefill workers (colocated: mixed = prefill + decode)")
        f.add_argument("--decode", type=int, default=1, help="decode workers")
        f.add_argument("--prefill-tp", type=int, default=1, help="GPUs per prefill worker")
        f.add_argument("--decode-tp", type=int, default=1, help="GPUs per decode worker")
        f.add_argument("--policy", choices=["kv_aware", "least_loaded", "round_robin", "random"], default="kv_aware")
    f.add_argument("--link", help="the prefill -> decode KV link: nvlink4, rdma-ndr400, tcp-25g, gloo-loopback "
                                  "(default: the device's)")
    f.add_argument("--block-size", type=int, default=16, help="KV block tokens (512 matches Mooncake trace ids)")
    f.add_argument("--num-blocks", type=int, help="KV blocks per worker (default: what device memory holds)")
    f.add_argument("--host-tier-gb", type=float, default=0.0,
                   help="HiCache host memory per prefill worker, GB (0: none); loads back over PCIe 5")
    f.add_argument("--disk-tier-gb", type=float, default=0.0,
                   help="HiCache disk per prefill worker, GB (0: none), under the host tier; read back over "
                        "--disk-link")
    f.add_argument("--disk-link", default="nvme-gen4", help="the disk tier's read link (default nvme-gen4)")
    f.add_argument("--max-num-seqs", type=int, default=256)
    f.add_argument("--max-num-batched-tokens", type=int, default=8192)
    f.add_argument("--stream-every", type=int, default=16, help="tokens per stream chunk (ITL is per chunk)")

    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=["random", "shared-prefix", "multi-turn", "trace"], default="random")
    w.add_argument("--workload-args", metavar="K=V,...", default="",
                   help="fields of `brigade bench`'s workload, e.g. num_groups=8,prompts_per_group=16,seed=1")
    w.add_argument("--request-rate", type=float, default=math.inf, help="sessions/s (trace: its own timestamps)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of gaps: 1 Poisson, < 1 burstier")
    w.add_argument("--trace-file", metavar="F.jsonl", help="trace: a Mooncake-format JSONL file")
    w.add_argument("--num-prompts", type=int, help="trace: the first N requests")
    w.add_argument("--trace-length-scale", type=float, default=1.0)
    w.add_argument("--trace-output-scale", type=float, default=1.0)
    w.add_argument("--trace-time-scale", type=float, default=1.0, help="0.5 replays twice as fast")


def add_parsers(sub: argparse._SubParsersAction) -> None:
    fmt = argparse.RawDescriptionHelpFormatter
    sim = sub.add_parser("sim", formatter_class=fmt, epilog=SIM_EPILOG, help="simulate a fleet (virtual time)",
                         description="Simulate a Brigade fleet: the real router and schedulers over GPU cost models.")
    cmds = sim.add_subparsers(dest="sim_command", required=True, metavar="<run|calibrate>")
    run = cmds.add_parser("run", formatter_class=fmt, epilog=SIM_EPILOG, help="one simulated run",
                          description="Replay a workload on a simulated fleet; writes result.json and report.html "
                                      "in `brigade bench`'s format.")
    _add_fleet(run)
    o = run.add_argument_group("output")
    o.add_argument("--slo", help="goodput SLOs as for brigade bench, e.g. ttft=2s,tpot=50ms")
    o.add_argument("--output-dir", default="sim-results")
    o.add_argument("--label")
    sim.set_defaults(run="cluster.sim_cmd", make_config=lambda args: None)

    cal = cmds.add_parser("calibrate", formatter_class=fmt, help="fit a device profile of this machine",
                          description="Time prefill and decode steps of the real engine here (CPU, in the dtype "
                                      "`brigade serve` picks here unless --dtype says) and fit a roofline device "
                                      "profile: --device FILE.json uses it. The profile describes the device's "
                                      "steps only: what a serving path adds per request (door, router, RPCs) "
                                      "and what workers sharing one machine's cores cost each other are not "
                                      "in it (the simulator gives each worker a device of its own).",
                          epilog="example:\n"
                                 "  brigade sim calibrate --preset bench --threads 1 --out this-machine.json\n"
                                 "  brigade sim run --model bench --device this-machine.json --workload random")
    cal.add_argument("--preset", default="bench", help="the engine preset to time (default bench)")
    cal.add_argument("--out", default="this-machine.json", help="where the profile goes")
    cal.add_argument("--threads", type=int, help="torch threads (default: torch's own): give what one served "
                                                  "worker has")
    cal.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                     help="the workers' dtype (default auto: bfloat16 where the CPU multiplies it in hardware, "
                          "else float32, as `brigade serve`)")

    p = sub.add_parser("plan", formatter_class=fmt, epilog=PLAN_EPILOG, help="the cheapest fleet meeting an SLO",
                       description="Search P:D ratios, worker counts, TP sizes and routing policies by simulation; "
                                   "recommend the cheapest configuration that meets the SLO.")
    _add_fleet(p, counts=False)
    s = p.add_argument_group("search")
    s.add_argument("--slo", required=True, help="e.g. ttft=2s,tpot=50ms")
    s.add_argument("--goodput", type=float, default=0.9, help="share of requests that must meet the SLO (0.9)")
    s.add_argument("--headroom", type=float, default=1.0,
                   help="count a request only if it meets the SLO with every device cost this many times the "
                        "profile's (>= 1; default 1: no margin). Size for the simulator's error and the "
                        "hardware's variation (docs/SIMULATOR.md), e.g. 1.2 where predictions run up to "
                        "20%% low")
    s.add_argument("--max-gpus", type=int, default=16)
    s.add_argument("--tp-sizes", default="1,2,4,8")
    s.add_argument("--policies", default="kv_aware,round_robin")
    s.add_argument("--modes", default="disaggregated,colocated")
    s.add_argument("--json", metavar="FILE", help="also write the whole search here")
    p.set_defaults(run="cluster.sim_cmd", make_config=lambda args: None, sim_command="plan")


def fleet_config(args: argparse.Namespace, counts: bool = True):
    from engine.config import SchedulerConfig
    from sim.fleet import FleetConfig

    base = FleetConfig()
    fields = {"model": args.model, "device": args.device, "link": args.link, "block_size": args.block_size,
              "num_blocks": args.num_blocks, "stream_every": args.stream_every,
              "host_tier_bytes": args.host_tier_gb * 1e9, "disk_tier_bytes": args.disk_tier_gb * 1e9,
              "disk_link": args.disk_link,
              "scheduler": SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                           max_num_batched_tokens=args.max_num_batched_tokens)}
    if counts:
        fields.update(mode=args.mode, prefill=args.prefill, decode=args.decode, prefill_tp=args.prefill_tp,
                      decode_tp=args.decode_tp, router=base.router.model_copy(update={"policy": args.policy}))
    return FleetConfig.model_validate({**base.model_dump(), **fields})


def _workload_args(text: str) -> dict:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"--workload-args: expected KEY=VALUE, got {part!r}")
        out[key.strip()] = value.strip()  # pydantic converts to each field's type
    return out


def sessions(args: argparse.Namespace) -> tuple[list, str]:
    from cluster.sim_bridge import from_loadtest
    from sim.trace import from_trace, load_trace

    if args.workload == "trace":
        if not args.trace_file:
            raise ValueError("--workload trace needs --trace-file F.jsonl (Mooncake format)")
        reqs = load_trace(args.trace_file, length_scale=args.trace_length_scale, output_scale=args.trace_output_scale,
                          time_scale=args.trace_time_scale, num_prompts=args.num_prompts)
        return from_trace(reqs), "trace"
    from pydantic import TypeAdapter, ValidationError

    from loadtest.workloads import WorkloadConfig

    try:
        cfg = TypeAdapter(WorkloadConfig).validate_python({"kind": args.workload,
                                                            **_workload_args(args.workload_args)})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"--workload-args: {problems}; see `brigade bench run --help` for the fields") from None
    return from_loadtest(cfg, args.request_rate, burstiness=args.burstiness), args.workload


def run(args: argparse.Namespace, _cfg) -> int:
    from loadtest.metrics import parse_slo

    if args.sim_command == "calibrate":
        return _calibrate(args)
    slo = parse_slo(args.slo)
    work, kind = sessions(args)
    if args.sim_command == "plan":
        return _plan(args, slo, work)
    from rich.console import Console

    from cluster.sim_bridge import bench_result
    from loadtest import report
    from sim.fleet import simulate

    run = simulate(fleet_config(args), work, slo or None)
    result = bench_result(run, slo or None, args.label, kind, args.request_rate)
    out = Path(args.output_dir)
    json_path = report.write_json(result, out / "result.json")
    html_path = report.write_html(result, out)
    Console().print(report.summary_table(result))
    sim = result["runs"][0]["sim"]
    print(f"simulated {sim['virtual_s']:.1f} s in {sim['wall_s']:.1f} s of wall time; queue share of TTFT "
          f"{sim['mean_queue_share_of_ttft']:.0%}; wrote {json_path} and {html_path}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    from sim.calibrate import fit, measure

    shape, samples, dtype_bytes = measure(args.preset, threads=args.threads, dtype=args.dtype)
    profile, report = fit(shape, samples, dtype_bytes)
    for e in report["samples"]:
        print(f"{e['kind']:8s} {e['tokens']:5d} tokens after {e['context']:5d}  "
              f"measured {e['measured_s'] * 1000:8.2f} ms  fitted {e['predicted_s'] * 1000:8.2f} ms  "
              f"({e['error']:+.1%})")
    decode_attn = "" if profile.decode_attn_eff is None else f", a decode batch's at {profile.decode_attn_eff:.2f}"
    print(f"peak {profile.peak_flops / 1e9:.1f} GFLOP/s (attention over cached context at {profile.attn_eff:.2f} "
          f"of it{decode_attn}, a fresh prompt's among its own tokens at {profile.prompt_attn_eff:.2f}), "
          f"memory {profile.mem_bw / 1e9:.1f} GB/s, step overhead {profile.step_overhead_s * 1000:.2f} ms + "
          f"{profile.seq_overhead_s * 1000:.2f} ms per sampled sequence")
    Path(args.out).write_text(profile.model_dump_json(indent=1))
    print(f"wrote {args.out}")
    return 0


def _plan(args: argparse.Namespace, slo: dict, work: list) -> int:
    from sim.plan import PlanConfig, plan

    if not slo:
        raise ValueError("--slo needs at least one of ttft, tpot, itl, e2el, e.g. ttft=2s,tpot=50ms")
    cfg = PlanConfig(base=fleet_config(args, counts=False), slo=slo, goodput=args.goodput, headroom=args.headroom,
                     max_gpus=args.max_gpus, tp_sizes=tuple(int(t) for t in args.tp_sizes.split(",")),
                     policies=tuple(args.policies.split(",")), modes=tuple(args.modes.split(",")))

    within = f" at {cfg.headroom:g}x the costs" if cfg.headroom > 1 else ""

    def show(r: dict) -> None:
        met = f"{r['slo_met']:6.1%}" + (f" ({r['headroom_met']:6.1%}{within})" if within else "")
        print(f"{r['gpus']:3d} GPUs  {_name(r):34s} SLO met {met}  p90 TTFT {_ms(r['p90_ttft_ms'])}"
              f"  mean TPOT {_ms(r['mean_tpot_ms'])}  queue share of TTFT {r['queue_share_of_ttft']:.0%}"
              f"{'  <- meets' if r['meets'] else ''}")

    result = plan(cfg, work, on_try=show)
    b = result["burst"]
    if b["mean_rate"]:
        print(f"arrivals: mean {b['mean_rate']:.2f}/s, busiest {b['window_s']:.0f} s window {b['peak_rate']:.2f}/s")
    best = result["recommended"]
    if best is None:
        print(f"no configuration up to {args.max_gpus} GPUs meets the SLO{within} for {args.goodput:.0%} of "
              "requests; raise --max-gpus, relax --slo" + (" or lower --headroom" if within else ""))
        near = result["closest"]
        if near is not None:
            print(f"closest: {_name(near)} on {near['gpus']} GPUs ({near['headroom_met']:.1%} of requests meet "
                  f"the SLO{within})")
    else:
        print(f"recommended: {_name(best)} on {best['gpus']} GPUs ({best['headroom_met']:.1%} of requests meet the "
              f"SLO{within})")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if best is not None else 1


def _name(r: dict) -> str:
    if r["mode"] == "colocated":
        return f"{r['prefill']} mixed x TP{r['prefill_tp']} {r['policy']}"
    return f"{r['prefill']}P(TP{r['prefill_tp']}):{r['decode']}D(TP{r['decode_tp']}) {r['policy']}"


def _ms(v) -> str:
    return f"{v:8.1f} ms" if v is not None else "       - ms"
