"""Simulated against measured: real `brigade serve` fleets on this machine, loaded with
`brigade bench run`, beside simulated runs of the same fleets and workloads on the profile
`brigade sim calibrate` fits here (sim_bench's validation and advisor parts).

A measured run and its simulation share everything that decides the result: the fleet (mode,
worker counts, KV blocks, block size, scheduler limits, the engine preset), and the requests
and their arrival times (the simulator builds them with loadtest's own generator, from the
same seed bench uses for each rate of a sweep). The simulated workers take the calibrated
step costs of a worker with the torch threads the real one gets (cores / workers).
"""
from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from cluster.steal import STOLEN, StealMeter

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"^Brigade serving .* at (http:\S+)/v1 ")
METRICS = {"ttft_p50": "p50_ttft_ms", "ttft_p90": "p90_ttft_ms", "tpot_mean": "mean_tpot_ms",
           "throughput": "request_throughput", "hit_ratio": "cache_hit_ratio"}


@dataclass(frozen=True)
class Fleet:
    """A configuration served for real and simulated. Colocated: `workers` mixed workers."""

    name: str
    mode: str  # "disaggregated" | "colocated"
    prefill: int = 0
    decode: int = 0
    workers_colocated: int = 0

    @property
    def workers(self) -> int:
        return self.workers_colocated if self.mode == "colocated" else self.prefill + self.decode

    def serve_flags(self) -> list[str]:
        # One core's share per worker, so each gets one torch thread, as the calibrated profile had.
        cpus = ["--num-cpus", str(self.workers)]
        if self.mode == "colocated":  # serving_bench.sh's colocated form: --decode N mixed workers
            return ["--mode", "colocated", "--decode", str(self.workers_colocated), *cpus]
        return ["--mode", "disaggregated", "--prefill", str(self.prefill), "--decode", str(self.decode), *cpus]

    def sim_fields(self) -> dict:
        if self.mode == "colocated":
            return {"mode": "colocated", "prefill": self.workers_colocated, "decode": 0}
        return {"mode": "disaggregated", "prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True)
class Load:
    """A shared-prefix workload (serving_bench.sh's) at a sweep of rates."""

    rates: tuple[float, ...]
    num_groups: int = 4
    prompts_per_group: int = 4
    system_prompt_len: int = 512
    question_len: int = 32
    output_len: int = 32
    burstiness: float = 1.0
    seed: int = 0
    vocab_size: int = 4096

    def bench_flags(self) -> list[str]:
        return ["--workload", "shared-prefix", "--num-groups", str(self.num_groups),
                "--prompts-per-group", str(self.prompts_per_group), "--system-prompt-len",
                str(self.system_prompt_len), "--question-len", str(self.question_len),
                "--output-len", str(self.output_len), "--request-rate", ",".join(map(str, self.rates)),
                "--burstiness", str(self.burstiness), "--seed", str(self.seed),
                "--vocab-size", str(self.vocab_size), "--ignore-eos", "--return-token-ids"]

    def workload(self, run_index: int):
        from loadtest.workloads.shared_prefix import SharedPrefixWorkload

        # bench draws the i-th rate's prompts and arrivals from seed + i (loadtest/runner.py)
        return SharedPrefixWorkload(num_groups=self.num_groups, prompts_per_group=self.prompts_per_group,
                                    system_prompt_len=self.system_prompt_len, question_len=self.question_len,
                                    output_len=self.output_len, seed=self.seed + run_index,
                                    vocab_size=self.vocab_size)


def _env() -> dict:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@contextmanager
def serve(fleet: Fleet, model: str, num_blocks: int, log_dir: Path, ready_timeout_s: float = 300):
    """`brigade serve` of the fleet; yields its base URL, stops it (SIGTERM, then SIGKILL) after."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out, err = log_dir / f"{fleet.name}.serve.out", log_dir / f"{fleet.name}.serve.log"
    cmd = [sys.executable, "-m", "cluster.cli", "serve", *fleet.serve_flags(), "--model", model, "--device", "cpu",
           "--num-blocks", str(num_blocks), "--http-port", "0", "--grpc-port", "0"]
    with out.open("w") as fo, err.open("w") as fe:
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, cwd=ROOT, env=_env())
    try:
        deadline = time.monotonic() + ready_timeout_s
        url = None
        while url is None:
            if proc.poll() is not None:
                raise RuntimeError(f"brigade serve ({fleet.name}) exited {proc.returncode}; see {err}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"brigade serve ({fleet.name}) not ready after {ready_timeout_s:.0f} s; see {err}")
            url = next((m.group(1) for line in out.read_text().splitlines() if (m := READY.match(line))), None)
            time.sleep(0.5)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench(url: str, load: Load, slo: str, out_dir: Path, label: str, warmup: int = 2) -> list[dict]:
    """`brigade bench run` of the load against url; the result's runs (one per rate)."""
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "run", "--url", url, "--label", label, "--output-dir",
           str(out_dir), "--no-progress", *load.bench_flags(), "--slo", slo, "--warmup", str(warmup)]
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / "result.json").read_text())["runs"]


def least_stolen(measure: Callable[[], T], what: str, attempts: int = 3) -> tuple[T, float]:
    """`measure()`, taken again while the hypervisor took more than STOLEN of the CPU time the
    machine wanted during it (cluster/steal.py: its spells slow every step by tens of percent
    for minutes), at most `attempts` times; the least stolen result and its steal share."""
    best: tuple[T, float] | None = None
    for attempt in range(1, attempts + 1):
        meter = StealMeter()
        result = measure()
        share = meter.share()
        if best is None or share < best[1]:
            best = (result, share)
        if share <= STOLEN:
            break
        print(f"  {what}: the hypervisor took {share:.0%} of the CPU time (steal)"
              + ("; measuring again" if attempt < attempts else "; keeping the least stolen try"), flush=True)
    return best


def calibrate(model: str, threads: int, out: Path, attempts: int = 3) -> dict:
    """`brigade sim calibrate` here (a subprocess: torch threads are per process); its profile.
    Tried again when the steps fit no roofline (a burst of other work during the timing), and
    while the hypervisor steals (least_stolen)."""
    cmd = [sys.executable, "-m", "cluster.cli", "sim", "calibrate", "--preset", model, "--threads", str(threads),
           "--out", str(out)]

    def fit() -> tuple[str, str]:
        for attempt in range(1, attempts + 1):
            done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
            if done.returncode == 0:
                return done.stdout, out.read_text()
            print(f"  calibrate attempt {attempt}: {done.stderr.strip().splitlines()[-1:]}", flush=True)
        raise RuntimeError(f"brigade sim calibrate failed {attempts} times: {done.stderr.strip()[-300:]}")

    (stdout, profile), _ = least_stolen(fit, "the engine fit")
    out.write_text(profile)
    out.with_suffix(".fit.out").write_text(stdout)  # each step's time against the fit
    return json.loads(profile)


# The serving path's time terms (its CPU on the same cores as the engine's steps); corun_slowdown
# is a ratio and stays.
SERVING_TIMES = ("request_overhead_s", "request_overhead_per_token_s", "worker_step_overhead_s", "token_overhead_s",
                 "decode_worker_step_overhead_s", "decode_token_overhead_s", "handoff_overhead_s",
                 "decode_admit_overhead_s", "kv_receive_cpu_per_token_s", "stream_cpu_s", "corun_wait_s",
                 "corun_wait_per_answer_s")


def engine_fit_around(model: str, before: dict, after: dict, serving: dict) -> dict:
    """A profile whose engine terms are the mean of two fits of the same steps (taken just
    before and just after a measured run: the machine's speed drifts between runs), and whose
    serving path's terms are `serving`'s, scaled by how far the engine's steps moved from
    `serving`'s own engine fit: both are CPU work on the same cores, and serving terms taken in
    a fast spell (the engine's decode steps 15-30% quicker than in the tries around them) put
    every 1P+1D figure of one run low (re-simulated with the scaling, that run's 21 latency
    errors summed 3.41 instead of 3.96, and another run's 2.31 instead of 2.44). Means of the
    per-unit times (1 / rate, overheads): the two fits share one design, so that is the fit of
    the mean step times; and of their decode batches' scales (sim/hardware.py decode_batch_scale)."""
    inv = {"peak_flops": lambda p: 1 / p["peak_flops"], "mem_bw": lambda p: 1 / p["mem_bw"],
           "attn": lambda p: 1 / (p["peak_flops"] * p["attn_eff"]),
           "prompt_attn": lambda p: 1 / (p["peak_flops"] * p.get("prompt_attn_eff", 1.0))}
    if before.get("decode_attn_eff") and after.get("decode_attn_eff"):
        inv["decode_attn"] = lambda p: 1 / (p["peak_flops"] * p["decode_attn_eff"])
    mean = {k: (f(before) + f(after)) / 2 for k, f in inv.items()}
    out = {**serving, "peak_flops": 1 / mean["peak_flops"], "mem_bw": 1 / mean["mem_bw"],
           "attn_eff": min(1.0, mean["peak_flops"] / mean["attn"]),
           "prompt_attn_eff": min(1.0, mean["peak_flops"] / mean["prompt_attn"]),
           "decode_attn_eff": min(1.0, mean["peak_flops"] / mean["decode_attn"]) if "decode_attn" in mean else None}
    for k in ("step_overhead_s", "seq_overhead_s"):
        out[k] = (before[k] + after[k]) / 2
    scales = [dict(map(tuple, p.get("decode_batch_scale") or ())) for p in (before, after)]
    out["decode_batch_scale"] = [(b, (scales[0][b] + scales[1][b]) / 2) for b in sorted(scales[0]) if b in scales[1]]
    speed = _decode_steps_s(model, out) / _decode_steps_s(model, serving)
    return out | {k: serving[k] * speed for k in SERVING_TIMES if serving.get(k) is not None}


def _fit(model: str, profile: dict):
    """The roofline a profile (a JSON dict) gives `model`'s steps."""
    from sim.cost import Roofline
    from sim.hardware import DeviceProfile
    from sim.shapes import load_shape

    return Roofline(load_shape(model), DeviceProfile.model_validate(profile))


def _decode_steps_s(model: str, profile: dict) -> float:
    """A decode step of 1 and of 4 short sequences, as `profile` times them: the batches the
    serving terms were measured beside."""
    from cluster.serving_costs import DECODE_TOKENS, SHORT_LEN
    from sim.cost import StepWork

    fit, context = _fit(model, profile), SHORT_LEN + DECODE_TOKENS // 2
    return sum(fit.step_s(StepWork.of([(1, context, True)] * width)) for width in (1, 4))


def engine_drift(model: str, before: dict, after: dict) -> float:
    """How far this machine's speed moved between two engine fits: the largest relative
    difference of the steps a validated run is made of (a decode batch of 1 and of 4, a
    512-token prompt, a 32-token prefix hit over 512, a decode batch of 8 at 1,024 tokens) as
    each fit predicts them."""
    from sim.cost import StepWork

    fits = [_fit(model, p) for p in (before, after)]
    steps = [StepWork.of([(1, 300, True)]), StepWork.of([(1, 300, True)] * 4), StepWork.of([(512, 0, True)]),
             StepWork.of([(32, 512, True)]), StepWork.of([(1, 1024, True)] * 8)]
    return max(abs(fits[1].step_s(w) / fits[0].step_s(w) - 1) for w in steps)


def calibrate_serving(model: str, url: str, profile: Path, disaggregated: bool = False,
                      log: Path | None = None) -> dict:
    """`brigade sim calibrate --serving-only` against a running `brigade serve` of `model`
    (colocated: --url; disaggregated: --disagg-url): the profile, with the serving path's costs.
    `log` keeps what it printed (what it measured, before the fit)."""
    cmd = [sys.executable, "-m", "cluster.cli", "sim", "calibrate", "--preset", model, "--threads", "1",
           "--disagg-url" if disaggregated else "--url", url, "--serving-only", "--out", str(profile)]
    start = profile.read_text()  # each try starts from the same profile (it rewrites it)

    def measure() -> tuple[str, str]:
        profile.write_text(start)
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        if done.returncode != 0:
            if log is not None:
                log.write_text(done.stdout + done.stderr)
            raise RuntimeError(f"brigade sim calibrate --serving-only failed: {done.stderr.strip()[-300:]}")
        return done.stdout + done.stderr, profile.read_text()

    flag = "--disagg-url" if disaggregated else "--url"
    (printed, measured), _ = least_stolen(measure, f"the serving path's costs ({flag})")
    profile.write_text(measured)
    if log is not None:
        log.write_text(printed)
    for line in printed.splitlines():  # a fit it does not trust, said where the run is watched
        if line.startswith("warning:"):
            print(f"  {line}", flush=True)
    return json.loads(measured)


def calibrate_here(model: str, num_blocks: int, profile_path: Path, log_dir: Path) -> dict:
    """This machine's profile as sim_bench fits it: the engine with 1 torch thread, then the
    serving path's costs on a 1-worker colocated serve (--url: request overhead, streaming CPU)
    and on a 1P+1D serve (--disagg-url: the decode worker's own, the handoff). A serve that
    fails leaves its terms out, said so."""
    print("calibrating this machine (brigade sim calibrate, 1 torch thread)", flush=True)
    profile = calibrate(model, 1, profile_path)
    for fleet in (Fleet("1mixed", "colocated", workers_colocated=1), Fleet("1p1d", "disaggregated", 1, 1)):
        print(f"  the serving path's costs (brigade sim calibrate --serving-only on {fleet.name})", flush=True)
        try:
            with serve(fleet, model, num_blocks, log_dir) as url:
                profile = calibrate_serving(model, url, profile_path, disaggregated=fleet.mode == "disaggregated",
                                            log=log_dir / f"{fleet.name}.calibrate.out")
        except (RuntimeError, subprocess.CalledProcessError) as exc:  # the simulation then leaves it out
            print(f"  serving path not measured on {fleet.name}: {exc}", flush=True)
    return profile


def fleet_config(fleet: Fleet, model: str, profile: Path, num_blocks: int, policy: str = "kv_aware"):
    """The simulated twin of `serve(fleet, ...)`: the same engine preset, KV pool, block size
    and scheduler limits as the real workers, the KV link the real pair uses (gloo over loopback)."""
    from engine.config import CacheConfig, SchedulerConfig
    from router.config import RouterConfig
    from sim.fleet import FleetConfig

    return FleetConfig(model=model, device=str(profile), link="gloo-loopback", block_size=CacheConfig().block_size,
                       num_blocks=num_blocks, scheduler=SchedulerConfig(), stream_every=1,
                       router=RouterConfig(policy=policy), **fleet.sim_fields())


def simulate_load(fleet: Fleet, load: Load, model: str, profile: Path, num_blocks: int, slo: dict) -> list[dict]:
    """One simulated run per rate of the load, as bench's runs (summary keys and records)."""
    from cluster.sim_bridge import from_loadtest
    from sim.fleet import simulate

    cfg = fleet_config(fleet, model, profile, num_blocks)
    runs = []
    for i, rate in enumerate(load.rates):
        sessions = from_loadtest(load.workload(i), rate, burstiness=load.burstiness)
        runs.append({**simulate(cfg, sessions, slo or None), "request_rate": rate})
    return runs


def errors(measured: dict, simulated: dict) -> dict[str, float | None]:
    """|simulated - measured| / measured for each validated figure (None where unmeasured)."""
    out = {}
    for key, field in METRICS.items():
        m, s = measured.get(field), simulated.get(field)
        out[key] = abs(s - m) / m if m and s is not None else None
    return out


def step_speed(measured: dict, simulated: dict) -> dict | None:
    """The served engine steps of a run against its simulation's (bench's "server_steps" and the
    simulator's, loadtest/server_steps.py), None where the server did not count them. Per kind
    ("prompt", "decode"): `wall_vs_simulated`, the served steps' wall time over the simulated
    steps' (the machine's sharing and co-running included on both sides), and `cpu_vs_alone`,
    the served steps' own CPU time over the same steps alone on the fitted engine: above 1, the
    machine's cores ran this try's steps slower than the engine fits around it measured,
    whatever the simulator's model of the serve. Decode steps also by batch (decoding sequences)."""
    from loadtest.server_steps import mean_step_ms

    served, sim = measured.get("server_steps"), simulated.get("server_steps")
    if not served or not sim:
        return None
    out: dict = {}
    for kind in ("prompt", "decode"):
        a, b = mean_step_ms(served, kind), mean_step_ms(sim, kind)
        if kind == "prompt":  # prompt lengths differ within a batch label: totals only
            a, b = _pooled(a), _pooled(b)
        rows = {k: {"steps": a[k]["steps"], "simulated_steps": b[k]["steps"], "served_ms": a[k]["wall_ms"],
                    "served_cpu_ms": a[k]["cpu_ms"], "simulated_ms": b[k]["wall_ms"], "alone_ms": b[k]["cpu_ms"]}
                for k in a if k in b}
        if not rows:
            continue
        n = {k: r["steps"] for k, r in rows.items()}
        total = {f: sum(n[k] * r[f] for k, r in rows.items()) for f in ("served_ms", "served_cpu_ms", "simulated_ms",
                                                                         "alone_ms")}
        out[kind] = {"wall_vs_simulated": total["served_ms"] / total["simulated_ms"],
                     "cpu_vs_alone": total["served_cpu_ms"] / total["alone_ms"],
                     **({"by_batch": rows} if kind == "decode" else {"steps": rows["all"]})}
    return out or None


def try_decode_speed(speeds: list[dict | None]) -> float | None:
    """How much slower a try's served decode steps computed than its profile's engine fits give
    them: the median over the try's runs (one per rate) of their step_speed's decode
    `cpu_vs_alone`; None where the server counted no decode steps."""
    vals = [s["decode"]["cpu_vs_alone"] for s in speeds if s and "decode" in s]
    return statistics.median(vals) if vals else None


def at_decode_speed(profile: Path, factor: float, out: Path) -> Path:
    """`profile` with every decode step's engine part `factor` times as long (its decode batch
    scales multiplied), written to `out`: a try re-simulated at the decode speed its served steps
    ran at, to tell the misses the machine's speed during the try explains from the model's."""
    prof = json.loads(profile.read_text())
    scales = prof.get("decode_batch_scale") or [(1, 1.0)]
    prof["decode_batch_scale"] = [(b, v * factor) for b, v in scales]
    out.write_text(json.dumps(prof, indent=1))
    return out


def _pooled(by_batch: dict[str, dict]) -> dict[str, dict]:
    """mean_step_ms's rows pooled into one row, named "all"."""
    steps = sum(r["steps"] for r in by_batch.values())
    if not steps:
        return {}
    return {"all": {"steps": steps, **{f: sum(r["steps"] * r[f] for r in by_batch.values()) / steps
                                       for f in ("wall_ms", "cpu_ms")}}}


def ttft_samples(run: dict) -> list[float]:
    """A run's TTFTs in ms (bench's records are dicts once read back; the simulator's are objects)."""
    out = []
    for r in run.get("records", []):
        t = r.get("ttft_s") if isinstance(r, dict) else r.ttft_s
        if t is not None:
            out.append(t * 1000)
    return sorted(out)
