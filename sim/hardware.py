"""Device and link profiles: the figures a roofline needs, from sim/data/devices.json (each
with its source there) or from a profile `brigade sim calibrate` fitted on this machine."""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

DATA = Path(__file__).parent / "data"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class LinkProfile(_Frozen):
    name: str
    bandwidth: float = Field(gt=0)  # bytes/s, one direction
    latency_s: float = Field(ge=0)  # per transfer

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth


class DeviceProfile(_Frozen):
    name: str
    peak_flops: float = Field(gt=0)  # dense, at dtype_bytes precision
    mem_bw: float = Field(gt=0)  # bytes/s
    mem_bytes: float = Field(gt=0)  # device memory: weights + KV pool
    compute_eff: float = Field(1.0, gt=0, le=1)  # reachable fraction of peak_flops
    bw_eff: float = Field(1.0, gt=0, le=1)  # reachable fraction of mem_bw
    # Attention's query-key work reaches this fraction of the matmuls' rate (a CPU engine's
    # paged attention runs well below its GEMMs: a fifth to a third on the machine here; calibrate
    # fits it from prefills over cached prefixes). 1 for the catalog's GPUs (fused kernels).
    attn_eff: float = Field(1.0, gt=0, le=1)
    # The same for a decode batch's attention over its contexts (None: attn_eff). A CPU engine
    # gathers every sequence's blocks and runs a few query rows per KV head: on the Zen3 machine
    # here a batch of 8 at 1,040 tokens of context stepped in 45 ms, where attn_eff, fitted on
    # prefix hits, gave 36 (calibrate fits it from decode batches at two contexts).
    decode_attn_eff: float | None = Field(None, gt=0, le=1)
    # And a fresh prompt's attention among its own tokens (a chunk's own): the dense causal
    # kernel, 1 (the matmuls' rate) for the catalog's GPUs. On the AVX-512 EPYC here in bfloat16
    # it ran below the GEMMs, and a fit at their rate put a 1,024-token prompt 11% low and a
    # 64-token one 11% high (calibrate fits it from fresh prompts of four lengths).
    prompt_attn_eff: float = Field(1.0, gt=0, le=1)
    # A decode step (every sequence adds one token) of a given batch over the roofline's, as
    # (batch, scale) pairs by batch; linear in between, the last pair's beyond it, 1 without
    # pairs. A CPU's kernels for a few rows are not a roofline's: on the AVX-512 EPYC here in
    # bfloat16 a batch of 2 stepped slower than one of 3 (10.1-11.0 ms against 9.4-9.6), which
    # a line through the batches put 9-14% low at 1 and 2, the batches a light load decodes.
    # calibrate sets it from its decode steps; () for the catalog's GPUs.
    decode_batch_scale: tuple[tuple[int, float], ...] = ()
    step_overhead_s: float = Field(0.0, ge=0)  # per engine step: launches, scheduling, sampling
    # Per sampled sequence per step, inside the engine: sampling and each sequence's own
    # bookkeeping (calibrate fits it; a GPU's batched sampler makes it negligible there).
    seq_overhead_s: float = Field(0.0, ge=0)
    # Per request, outside the engine's steps: the door's parsing and tokenizing, the router's
    # pick, the actor calls there and back. `brigade sim calibrate --url` measures it on a real
    # `brigade serve`; the catalog's GPUs leave it 0 (not modelled).
    request_overhead_s: float = Field(0.0, ge=0)
    request_overhead_per_token_s: float = Field(0.0, ge=0)  # and per prompt token (its ids through each hop)
    # A served worker's decode step beyond the engine's: per step (its loop, the actor) and per
    # sampled sequence (its chunk's way out of the engine and the actor). calibrate --url
    # measures both on a colocated worker; 0 for the catalog's GPUs.
    worker_step_overhead_s: float = Field(0.0, ge=0)
    token_overhead_s: float = Field(0.0, ge=0)
    # The same two in a disaggregated fleet's decode worker (calibrate --disagg-url; None: as
    # the colocated worker's). They differ: alone, one token costs such a decode worker 40%
    # more than a colocated one on the AMD machine here.
    decode_worker_step_overhead_s: float | None = Field(None, ge=0)
    decode_token_overhead_s: float | None = Field(None, ge=0)
    # Per request of a disaggregated fleet, beyond request_overhead_s: the decode worker's
    # reservation and the prefill worker's answer (calibrate --disagg-url; 0 for the catalog's GPUs).
    handoff_overhead_s: float = Field(0.0, ge=0)
    # Per request of a disaggregated fleet, between its first token and the decode worker taking
    # it in: the router's call to the decode actor, its push request to the prefill worker, the
    # pull thread's and the engine loop's wake-ups (calibrate --disagg-url: the gap from the first
    # token to the second, less a steady token's; 20-30 ms on the Zen3 machine here; 0 for the GPUs).
    # On a CPU host it is work on the cores the steps share (sim/worker.py), else a latency.
    decode_admit_overhead_s: float = Field(0.0, ge=0)
    # Per KV token a disaggregated decode worker receives, the CPU its pull thread spends taking
    # it in (beside the link's time), on host_cores (calibrate --disagg-url; 0 for the GPUs: a
    # NIC's or NVLink's copy engine moves it). About 17 us in float32 on the slow AMD machine here.
    kv_receive_cpu_per_token_s: float = Field(0.0, ge=0)
    # A CPU machine: its cores, shared by every worker's engine thread and the serving path
    # (processor sharing, sim/cpu_host.py). None: each worker has its device to itself (a GPU).
    host_cores: float | None = Field(None, gt=0)
    # Per streamed token, the serving path's CPU outside the worker's step (the router, the
    # door, the client, the worker's own actor and Ray threads), on host_cores beside the
    # workers (calibrate --url; 0 for the GPUs).
    stream_cpu_s: float = Field(0.0, ge=0)
    # Of host_cores, what the serve keeps busy with no request in flight: `background_cores` its
    # processes beside the workers (Ray's raylet and GCS, Redis, the door's and router's loops:
    # their polling and heartbeats) and `worker_background_cores` each worker process more (its
    # actor's and Ray's threads). Steps get the cores left when more are runnable than that
    # leaves (sim/cpu_host.py). calibrate --url measures both on its colocated serve, idle: 0.08
    # and 0.03 cores on the 2-core Xeon here; without them two colocated workers' answers side
    # by side were simulated 10-14% fast. 0 for the GPUs (a host's cores are not what limits a step).
    background_cores: float = Field(0.0, ge=0)
    worker_background_cores: float = Field(0.0, ge=0)
    # On host_cores: a step computing prompt tokens (and decoding none) that starts while other
    # workers' steps decode first waits corun_wait_s, and corun_wait_per_answer_s more for each
    # answer they decode beyond the first, then gets at most 1 / corun_slowdown of a core, less
    # if its fair share is less (run-queue waits behind the threads each streamed token wakes; a
    # hit's growth there is part fixed, part proportional to its step: sim/cpu_host.py).
    # calibrate --disagg-url fits the first two and the ceiling on a 1 prefill + 1 decode serve
    # beside one answer, the per-answer part beside three; 0, 0 and 1: none. The waits are a
    # disaggregated fleet's only (a hit's way through a busy decode worker); the ceiling every fleet's.
    corun_wait_s: float = Field(0.0, ge=0)
    corun_wait_per_answer_s: float = Field(0.0, ge=0)
    corun_slowdown: float = Field(1.0, ge=1)
    # The ceiling holds for the first corun_span_s of a prompt step only (None: the whole step):
    # a cold 512-token prompt beside an answer grew far less than a ceiling fitted on short hits
    # gives a step that long. calibrate --disagg-url fits it on the scene's cold prompts.
    corun_span_s: float | None = Field(None, gt=0)
    # On host_cores: a disaggregated decode worker's step, while another worker's step computes
    # prompt tokens, gets at most 1 / decode_corun_slowdown of a core (the prompt's way in wakes
    # the decode worker's own threads: its reservation, the KV pull, the admit). calibrate
    # --disagg-url fits it from the co-run scene's answer, streamed beside the hits and alone; 1: none.
    decode_corun_slowdown: float = Field(1.0, ge=1)
    # On host_cores: while more jobs are runnable than the cores the background leaves, every
    # step does its work this much slower (its core shared with the threads that preempt it,
    # its caches refilled after them). calibrate --url times a served worker's decode steps'
    # CPU (its step log) with an engine stepping beside it in another process, against alone:
    # on the 2-core Xeon here two colocated workers' decode steps of one sequence took 16.1 ms
    # of CPU under load and 14.0 one answer at a time. 1: none (the GPUs).
    oversubscribed_slowdown: float = Field(1.0, ge=1)
    # A request's serving-path time beyond its median on a CPU host (thread wake-ups, run-queue
    # waits, Ray's and gRPC's queues): quantiles at evenly spaced probabilities from 0 to 1, in
    # seconds from the median, each request drawing one (FleetConfig.seed). calibrate
    # --disagg-url takes them from its short lone prefix hits' TTFTs; () : every request the median
    # (the GPUs). Without them the simulated lone hits all took one time where the measured ones
    # spread over 35-50 ms, and a run's p50 TTFT, which falls where the lone hits give way to
    # those beside a stream, sat at the lone hits' median instead of their upper part.
    request_jitter_s: tuple[float, ...] = ()
    # A CPU host shared with other tenants: what was idle finds its working set gone from the
    # caches, so its first work is slower. (idle seconds, extra seconds) pairs, linear between,
    # from 0 at no idle, the last pair's beyond; () none (the GPUs). `cold_step_s`: an engine
    # step whose worker last stepped that long ago (the bench preset's decode step here took 14.3
    # ms back to back, 19.1 after 0.4 s idle and 24.4 after 2 s: its weights re-read from memory
    # the neighbours' work evicted them to); `cold_request_s`: a request that finds the host's
    # cores idle that long, beyond its step's (the door, the router, the actor calls: a cached
    # prompt's TTFT on a served worker was 29 ms back to back, 40-44 after 0.3-0.4 s idle).
    # calibrate --url times both (cluster/serving_costs.py); the calls it times otherwise run back
    # to back, and without them a colocated fleet's lone hits were simulated 7 ms fast.
    cold_step_s: tuple[tuple[float, float], ...] = ()
    cold_request_s: tuple[tuple[float, float], ...] = ()
    dtype_bytes: int = Field(2, ge=1)  # weights and KV
    intra_link: str = "nvlink4"  # between the ranks of one TP group
    inter_link: str = "rdma-ndr400"  # between a prefill and a decode worker

    def decode_scale(self, batch: int) -> float:
        """decode_batch_scale at `batch`."""
        return _linear(self.decode_batch_scale, batch) if self.decode_batch_scale else 1.0

    @field_validator("cold_step_s", "cold_request_s")
    @classmethod
    def _idles_rise(cls, pairs: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        idles = [idle for idle, _ in pairs]
        if any(b <= a for a, b in zip([0.0, *idles], idles)) or any(extra < 0 for _, extra in pairs):
            raise ValueError(f"(idle seconds, extra seconds) pairs with rising idles > 0 and extras >= 0, not {pairs}")
        return pairs

    def cold_step(self, idle_s: float) -> float:
        """The extra seconds of an engine step whose worker idled `idle_s` (cold_step_s)."""
        return _after_idle(self.cold_step_s, idle_s)

    def cold_request(self, idle_s: float) -> float:
        """The extra seconds of a request's serving path after the host idled `idle_s` (cold_request_s)."""
        return _after_idle(self.cold_request_s, idle_s)

    def jitter_s(self, u: float) -> float:
        """request_jitter_s's value at probability `u` (in [0, 1]), linear between quantiles."""
        q = self.request_jitter_s
        if len(q) < 2:
            return q[0] if q else 0.0
        x = u * (len(q) - 1)
        i = min(int(x), len(q) - 2)
        return q[i] + (q[i + 1] - q[i]) * (x - i)

    def slowed(self, factor: float) -> DeviceProfile:
        """This device with every cost `factor` times as large: its rates divided by it, every
        time (per step, per sequence, per token, per request, the serving path's) multiplied.
        Links keep their own figures."""
        if factor < 1:
            raise ValueError(f"a slowdown is >= 1, not {factor}")
        if factor == 1:
            return self
        times = {k: tuple(_times(x, factor) for x in v) if isinstance(v, tuple) else v * factor
                 for k, v in self if k.endswith("_s") and v is not None}
        return self.model_copy(update={"peak_flops": self.peak_flops / factor, "mem_bw": self.mem_bw / factor,
                                       **times})


def _times(x: float | tuple[float, float], factor: float) -> float | tuple[float, float]:
    """A time `factor` times as long; of an (idle, extra) pair, the extra."""
    return (x[0], x[1] * factor) if isinstance(x, tuple) else x * factor


def _after_idle(pairs: tuple[tuple[float, float], ...], idle_s: float) -> float:
    """(idle, extra) pairs at `idle_s`: 0 at no idle, linear between, the last beyond."""
    return _linear(((0.0, 0.0), *pairs), idle_s) if pairs else 0.0


def _linear(points: tuple[tuple[float, float], ...], x: float) -> float:
    """The line through (x, y) `points` (rising x) at `x`: the first's y before them, the last's beyond."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _catalog() -> dict:
    return json.loads((DATA / "devices.json").read_text())


def device_names() -> list[str]:
    return sorted(_catalog()["devices"])


def load_device(name_or_path: str) -> DeviceProfile:
    """A profile by catalog name (H100-SXM, H200, H20, cpu-2core) or a JSON file (calibrate's output)."""
    path = Path(name_or_path)
    if path.suffix == ".json" and path.exists():
        return DeviceProfile.model_validate_json(path.read_text())
    devices = _catalog()["devices"]
    if name_or_path not in devices:
        raise ValueError(f"unknown device {name_or_path!r}: use one of {', '.join(sorted(devices))} "
                         "or a profile JSON written by `brigade sim calibrate`")
    return DeviceProfile(name=name_or_path, **devices[name_or_path])


def load_link(name: str) -> LinkProfile:
    links = {k: v for k, v in _catalog()["links"].items() if not k.startswith("_")}
    if name not in links:
        raise ValueError(f"unknown link {name!r}: use one of {', '.join(sorted(links))}")
    return LinkProfile(name=name, **links[name])
