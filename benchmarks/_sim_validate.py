"""The pieces of sim_bench's validation: real `brigade serve` fleets on this machine loaded with
`brigade bench run`, and their simulated twins.

A measured run and its simulation share everything that decides the result: the fleet (mode,
worker counts, KV blocks, block size, scheduler limits, the engine preset) and the requests
and their arrival times (the simulator builds them with loadtest's own generator, from the
seed bench uses for each rate of a sweep).

The product simulator gives every worker a device of its own and knows nothing of a serving
path. The fleets measured here share one machine's cores and pay a serving path (the door,
the router, the actor calls) that is a large part of a short request's time on a CPU, so the
twin adds this machine's model, and only here:
- `SharedCores`, the StepHost its workers' steps run on: the machine's cores shared among the
  steps running at once and the serving path's CPU for each streamed token (processor sharing);
- a served worker's per-step and per-sequence cost beyond its engine's, folded into the device's
  step and sequence overheads;
- `with_serving_path`: each request's serving latency (per request, per prompt token, a
  disaggregated fleet's handoff) added to its every token, and a disaggregated decode worker's
  admission (from the first token to its pull) to every token after the first.
Its serving terms are measured on this machine's serves (`serving_probe`) and stored with the tries.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.harness.served import served_fleet

ROOT = Path(__file__).resolve().parents[1]
# validated figure -> bench's summary key
METRICS = {"ttft_p50": "p50_ttft_ms", "ttft_p90": "p90_ttft_ms", "tpot_mean": "mean_tpot_ms",
           "throughput": "request_throughput", "hit_ratio": "cache_hit_ratio"}
FIGURES = (*METRICS.values(), "request_goodput", "completed", "failed")
# A figure whose tries barely differ (a hit ratio fixed by the prompts) is held to this share of
# its mean as its spread, so a hair's difference is not many spreads.
MIN_SPREAD = 0.01


@dataclass(frozen=True)
class Fleet:
    """A configuration served for real and simulated. Colocated: `workers_colocated` mixed workers."""

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
        if self.mode == "colocated":
            return ["--mode", "colocated", "--decode", str(self.workers_colocated), *cpus]
        return ["--mode", "disaggregated", "--prefill", str(self.prefill), "--decode", str(self.decode), *cpus]

    def sim_fields(self) -> dict:
        if self.mode == "colocated":
            return {"mode": "colocated", "prefill": self.workers_colocated, "decode": 0}
        return {"mode": "disaggregated", "prefill": self.prefill, "decode": self.decode}


def fleet_named(name: str) -> Fleet:
    """'2mixed' -> 2 colocated workers, '2p1d' -> 2 prefill + 1 decode."""
    if m := re.fullmatch(r"(\d+)mixed", name):
        return Fleet(name, "colocated", workers_colocated=int(m.group(1)))
    if m := re.fullmatch(r"(\d+)p(\d+)d", name):
        return Fleet(name, "disaggregated", prefill=int(m.group(1)), decode=int(m.group(2)))
    raise ValueError(f"not a fleet name: {name!r} (NmixeD or NpMd)")


@dataclass(frozen=True)
class Load:
    """A shared-prefix workload at a sweep of rates."""

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

    def sessions(self, rate_index: int, seed_offset: int = 0) -> list:
        """The simulated sessions of the `rate_index`-th rate, as bench draws them (seed + index)."""
        from cluster.sim_bridge import from_loadtest
        from loadtest.workloads.shared_prefix import SharedPrefixWorkload

        work = SharedPrefixWorkload(num_groups=self.num_groups, prompts_per_group=self.prompts_per_group,
                                    system_prompt_len=self.system_prompt_len, question_len=self.question_len,
                                    output_len=self.output_len, seed=self.seed + seed_offset + rate_index,
                                    vocab_size=self.vocab_size)
        return from_loadtest(work, self.rates[rate_index], burstiness=self.burstiness)


# -- the measured side --------------------------------------------------------------------------
def _env() -> dict:
    return {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
            "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


@contextmanager
def serve(fleet: Fleet, model: str, num_blocks: int, log_dir: Path, ready_timeout_s: float = 300):
    """`brigade serve` of the fleet (the served-fleet harness); yields its base URL."""
    log_dir.mkdir(parents=True, exist_ok=True)
    flags = [*fleet.serve_flags(), "--model", model, "--device", "cpu", "--num-blocks", str(num_blocks),
             "--http-port", "0", "--grpc-port", "0"]
    with served_fleet(flags, log_dir / f"{fleet.name}.serve.log", timeout_s=ready_timeout_s) as served:
        yield served.http_base


def bench(url: str, load: Load, slo: str, out_dir: Path, label: str, warmup: int = 2) -> list[dict]:
    """`brigade bench run` of the load against url; the result's runs (one per rate)."""
    cmd = [sys.executable, "-m", "cluster.cli", "bench", "run", "--url", url, "--label", label, "--output-dir",
           str(out_dir), "--no-progress", *load.bench_flags(), "--slo", slo, "--warmup", str(warmup)]
    subprocess.run(cmd, cwd=ROOT, env=_env(), check=True, stdout=subprocess.DEVNULL)
    return json.loads((out_dir / "result.json").read_text())["runs"]


def calibrate(model: str, out: Path, attempts: int = 3) -> dict:
    """`brigade sim calibrate` here with one torch thread (a subprocess: torch threads are per
    process), tried again when the steps fit no roofline (a burst of other work); its profile."""
    cmd = [sys.executable, "-m", "cluster.cli", "sim", "calibrate", "--preset", model, "--threads", "1",
           "--out", str(out)]
    for attempt in range(1, attempts + 1):
        done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True)
        if done.returncode == 0:
            out.with_suffix(".fit.out").write_text(done.stdout)  # each step's time against the fit
            return json.loads(out.read_text())
        print(f"  calibrate attempt {attempt}: {done.stderr.strip().splitlines()[-1:]}", flush=True)
    raise RuntimeError(f"brigade sim calibrate failed {attempts} times: {done.stderr.strip()[-300:]}")


def mean_fit(before: dict, after: dict) -> dict:
    """The device whose steps are the mean of two fits' (taken just before and just after a
    measured try: this machine's speed drifts within minutes): means of the per-unit times."""
    inv = {"flops": lambda p: 1 / p["peak_flops"], "bw": lambda p: 1 / p["mem_bw"],
           "attn": lambda p: 1 / (p["peak_flops"] * p["attn_eff"]),
           "prompt_attn": lambda p: 1 / (p["peak_flops"] * p["prompt_attn_eff"])}
    if before.get("decode_attn_eff") and after.get("decode_attn_eff"):
        inv["decode_attn"] = lambda p: 1 / (p["peak_flops"] * p["decode_attn_eff"])
    mean = {k: (f(before) + f(after)) / 2 for k, f in inv.items()}
    return {**before, "peak_flops": 1 / mean["flops"], "mem_bw": 1 / mean["bw"],
            "attn_eff": min(1.0, mean["flops"] / mean["attn"]),
            "prompt_attn_eff": min(1.0, mean["flops"] / mean["prompt_attn"]),
            "decode_attn_eff": min(1.0, mean["flops"] / mean["decode_attn"]) if "decode_attn" in mean else None,
            "step_overhead_s": (before["step_overhead_s"] + after["step_overhead_s"]) / 2,
            "seq_overhead_s": (before["seq_overhead_s"] + after["seq_overhead_s"]) / 2}


def engine_drift(model: str, before: dict, after: dict) -> float:
    """How far this machine's speed moved between two fits: the largest relative difference of
    the steps a validated run is made of (decode batches of 1, 4 and 8, a 512-token prompt, a
    32-token prefix hit over 512) as each fit predicts them."""
    from sim.cost import Roofline, StepWork
    from sim.hardware import DeviceProfile
    from sim.shapes import load_shape

    fits = [Roofline(load_shape(model), DeviceProfile.model_validate(p)) for p in (before, after)]
    steps = [StepWork.of([(1, 300, True)]), StepWork.of([(1, 300, True)] * 4), StepWork.of([(512, 0, True)]),
             StepWork.of([(32, 512, True)]), StepWork.of([(1, 1024, True)] * 8)]
    return max(abs(fits[1].step_s(w) / fits[0].step_s(w) - 1) for w in steps)


def serving_probe(url: str, device: dict, model: str, disaggregated: bool, requests: int = 12) -> dict:
    """This machine's serving terms on a running serve: one request at a time, a 4-token prompt
    answered with 1 token (its TTFT less the device's step: the serving latency) and with 33
    (its time per token less the device's decode step: a served worker's per-sequence cost; on
    a disaggregated serve, the gap from the first token to the second beyond it: the admission)."""
    from benchmarks._common import CpuWatch
    from sim.cost import Roofline, StepWork
    from sim.hardware import DeviceProfile
    from sim.shapes import load_shape

    fit = Roofline(load_shape(model), DeviceProfile.model_validate(device))
    decode_s = fit.step_s(StepWork.of([(1, 20, True)]))
    firsts, gaps, per_token, stream_cpu = [], [], [], []
    for i in range(requests):
        prompt = [7 + (i * 131 + j) % 4000 for j in range(4)]
        firsts.append(_stream_times(url, prompt, 1)[0] - fit.step_s(StepWork.of([(4, 0, True)])))
        watch = CpuWatch()
        times = _stream_times(url, [p + 1 for p in prompt], 33)
        seen = watch.stop()
        steady = (times[-1] - times[1]) / (len(times) - 2)
        per_token.append(steady - decode_s)
        gaps.append(times[1] - times[0] - steady)
        # the serve's CPU beyond its engine's steps, per token (the machine's other busy time)
        others = seen.get("other_cpu_share", 0.0) * seen["wall_s"] * (os.cpu_count() or 1)
        stream_cpu.append((others - 33 * decode_s) / 33)
    latency = max(0.0, statistics.median(firsts))
    token = max(0.0, statistics.median(per_token))
    out = {"request_overhead_s": latency, "request_overhead_per_token_s": 0.0, "worker_step_overhead_s": 0.0,
           "stream_cpu_s": max(0.0, statistics.median(stream_cpu))}
    if disaggregated:
        return {**out, "handoff_overhead_s": 0.0, "decode_admit_overhead_s": max(0.0, statistics.median(gaps)),
                "decode_token_overhead_s": token, "decode_worker_step_overhead_s": 0.0}
    return {**out, "token_overhead_s": token}


def _stream_times(url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Seconds from send to each streamed token of one completion (token ids in, greedy)."""
    import httpx

    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0.0}
    start, times = time.perf_counter(), []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and json.loads(line[6:])["choices"][0]["text"]:
                times.append(time.perf_counter() - start)
    return times


# -- the simulated side ---------------------------------------------------------------------------
class SharedCores:
    """A StepHost for one machine's cores shared by every worker's steps and the serving path's
    CPU: while more jobs run than there are cores, each runs at cores / running (processor
    sharing). Each step's sampled tokens leave `stream_cpu_s` apiece of work behind it (the
    door's, the router's, the client's and the actors' share of streaming each token), which
    nothing waits for but which takes its share of the cores."""

    steady = False  # a step's time depends on what runs beside it

    def __init__(self, cores: float, stream_cpu_s: float = 0.0):
        self.cores, self.stream_cpu_s = cores, stream_cpu_s
        self._left: dict[asyncio.Future, float] = {}  # a running step -> its work left, in seconds alone
        self._at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    async def step(self, seconds: float, *, prompt: bool, decode: int) -> None:
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        done = loop.create_future()
        self._left[done] = seconds
        self._plan(loop)
        await done
        streamed = self.stream_cpu_s * (decode + prompt)
        if streamed > 0:
            self._advance(loop.time())
            self._left[loop.create_future()] = streamed
            self._plan(loop)

    def _rate(self) -> float:
        return min(1.0, self.cores / len(self._left)) if self._left else 1.0

    def _advance(self, now: float) -> None:
        rate = self._rate()
        for job in self._left:
            self._left[job] -= (now - self._at) * rate
        self._at = now

    def _plan(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._left:
            self._timer = loop.call_at(self._at + max(0.0, min(self._left.values())) / self._rate(), self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop.time())
        for job in [j for j, left in self._left.items() if left <= 1e-12]:
            del self._left[job]
            job.set_result(None)
        self._plan(loop)


def served_device(device: dict, serving: dict, disaggregated: bool) -> dict:
    """The device a served worker of this machine steps as: its per-step and per-sequence
    overheads with what the worker adds beyond its engine (a disaggregated fleet's decode
    worker's where measured: it samples nearly every sequence there)."""
    step = serving.get("decode_worker_step_overhead_s") if disaggregated else None
    token = serving.get("decode_token_overhead_s") if disaggregated else None
    step = serving.get("worker_step_overhead_s") or 0.0 if step is None else step
    token = serving.get("token_overhead_s") or 0.0 if token is None else token
    return {**device, "step_overhead_s": device["step_overhead_s"] + step,
            "seq_overhead_s": device["seq_overhead_s"] + token}


def with_serving_path(run: dict, serving: dict, disaggregated: bool, slo: dict | None) -> dict:
    """`run` (sim.fleet.simulate's) with each request's serving latency on its every token, and a
    disaggregated decode worker's admission on every token after the first; summarized again."""
    from sim.metrics import summarize

    admit = (serving.get("decode_admit_overhead_s") or 0.0) if disaggregated else 0.0
    handoff = (serving.get("handoff_overhead_s") or 0.0) if disaggregated else 0.0
    records, latest = [], 0.0
    for r in run["records"]:
        way = (serving.get("request_overhead_s") or 0.0) + handoff + (
            serving.get("request_overhead_per_token_s") or 0.0) * r.prompt_tokens
        chunks = [t + way + (admit if i else 0.0) for i, t in enumerate(r.chunk_times_s)]
        e2e = None if r.e2e_s is None else max([r.e2e_s + way + (admit if len(chunks) > 1 else 0.0), *chunks])
        rec = replace(r, chunk_times_s=chunks, e2e_s=e2e, ttft_s=chunks[0] if r.ttft_s is not None and chunks else
                      r.ttft_s)
        latest = max(latest, r.start_s + (e2e or 0.0))
        records.append(rec)
    duration = max(run["duration"], latest)
    return {**run, **summarize(records, duration, slo), "records": records, "duration": duration}


def simulate_twin(fleet: Fleet, model: str, num_blocks: int, device: dict, serving: dict, cores: float,
                  sessions: list, slo: dict | None) -> dict:
    """The simulated twin of one measured run: the same fleet, KV pool, block size, scheduler
    limits and KV link (gloo over loopback) as the real workers, on this machine's model."""
    from engine.config import CacheConfig, SchedulerConfig
    from router.config import RouterConfig
    from sim.fleet import FleetConfig, simulate

    disaggregated = fleet.mode == "disaggregated"
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(served_device(device, serving, disaggregated), f)
    profile = Path(f.name)
    cfg = FleetConfig(model=model, device=str(profile), link="gloo-loopback", block_size=CacheConfig().block_size,
                      num_blocks=num_blocks, scheduler=SchedulerConfig(), stream_every=1,
                      router=RouterConfig(policy="kv_aware"), **fleet.sim_fields())
    try:
        run = simulate(cfg, sessions, slo, host=lambda: SharedCores(cores, serving.get("stream_cpu_s") or 0.0))
    finally:
        profile.unlink(missing_ok=True)
    return with_serving_path(run, serving, disaggregated, slo)


# -- errors in units of the measured spread ---------------------------------------------------------
def spread_errors(measured: list[dict], simulated: list[dict]) -> dict[str, dict]:
    """Per validated figure over a point's tries: the measured mean, its run-to-run standard
    deviation (at least MIN_SPREAD of the mean) and min-max, the simulated mean, and the error
    `spreads` = |simulated mean - measured mean| / that deviation (`relative`: over the mean)."""
    out = {}
    for key, field in METRICS.items():
        m = [r[field] for r in measured if r.get(field) is not None]
        s = [r[field] for r in simulated if r.get(field) is not None]
        if len(m) < 2 or not s:
            out[key] = None
            continue
        mean, sim = statistics.fmean(m), statistics.fmean(s)
        sd = max(statistics.stdev(m), MIN_SPREAD * abs(mean))
        out[key] = {"measured_mean": mean, "measured_stdev": statistics.stdev(m), "measured_min": min(m),
                    "measured_max": max(m), "simulated_mean": sim, "spreads": abs(sim - mean) / sd if sd else 0.0,
                    "relative": abs(sim - mean) / abs(mean) if mean else None, "in_range": min(m) <= sim <= max(m)}
    return out


def figures(run: dict) -> dict:
    return {k: run.get(k) for k in FIGURES}


def ttft_samples(run: dict) -> list[float]:
    """A run's TTFTs in ms (bench's records are dicts once read back; the simulator's are objects)."""
    out = []
    for r in run.get("records", []):
        t = r.get("ttft_s") if isinstance(r, dict) else r.ttft_s
        if t is not None:
            out.append(t * 1000)
    return sorted(out)
