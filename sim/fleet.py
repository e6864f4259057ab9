"""A simulated fleet: its config, the real Router over SimWorkers, and one run of a workload
through it on the virtual clock, reported in `brigade bench`'s result format."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.config import SchedulerConfig
from engine.messages import GenerateRequest
from engine.sampling import SamplingParams
from router.config import RouterConfig
from router.errors import NoWorker, Overloaded
from router.router import Router
from sim.clock import run_virtual
from sim.cost import Roofline
from sim.engine import OUT_TOKEN, SimEngine
from sim.hardware import load_device, load_link
from sim.index import MemoryIndex, MemoryIndexView
from sim.metrics import SimRecord, summarize
from sim.shapes import load_shape
from sim.worker import Network, SimWorker, StepHost


class FleetConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = "Qwen3-32B"  # a config.json, a shipped shape (sim/data/models) or an engine preset
    device: str = "H200"  # a catalog name or a calibrated profile JSON
    slowdown: float = Field(1.0, ge=1)  # every cost of the device this many times its profile's (plan's headroom)
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    prefill: int = Field(1, ge=0)  # colocated: the number of mixed workers is prefill + decode
    decode: int = Field(1, ge=0)
    prefill_tp: int = Field(1, ge=1)
    decode_tp: int = Field(1, ge=1)
    link: str | None = None  # prefill -> decode KV link; None: the device's inter_link
    block_size: int = Field(16, ge=1)
    num_blocks: int | None = Field(None, ge=2)  # per worker; None: what the device memory holds
    memory_fraction: float = Field(0.9, gt=0, le=1)
    host_tier_bytes: float = Field(0, ge=0)  # HiCache host memory per prefill/mixed worker (0: none)
    host_link: str = "pcie5-x16"  # host memory <-> device
    disk_tier_bytes: float = Field(0, ge=0)  # HiCache disk (L3) per prefill/mixed worker, under the host tier
    disk_link: str = "nvme-gen4"  # disk -> device (reads; writes happen off the critical path)
    scheduler: SchedulerConfig = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192)
    router: RouterConfig = RouterConfig(health_interval_s=5.0, max_running=100_000, max_waiting=100_000,
                                        max_waiting_tokens=10**12)
    stream_every: int = Field(16, ge=1)  # tokens per stream chunk (ITL is measured per chunk)
    publish_delay_s: float = Field(0.05, ge=0)  # cache events reach the index this much later
    seed: int = 0  # the random policy's draws
    failures: tuple[tuple[str, float], ...] = ()  # (worker id, virtual second): the worker dies then

    @model_validator(mode="after")
    def _workers(self) -> FleetConfig:
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError("a disaggregated fleet needs at least 1 prefill and 1 decode worker")
        if self.mode == "colocated" and self.prefill + self.decode < 1:
            raise ValueError("a colocated fleet needs at least 1 worker")
        return self

    @property
    def gpus(self) -> int:
        return self.prefill * self.prefill_tp + self.decode * self.decode_tp


@dataclass(frozen=True)
class SimSession:
    """A conversation as loadtest's runner sends it: turn k+1 goes `think_time_s` after turn
    k's answer and resends the whole history (system, turns, answers). A prompt part is token
    ids, or anything list() turns into them (made only while its request runs)."""

    session_id: str
    arrival_s: float
    turns: tuple[tuple[object, int], ...]  # (prompt part, output tokens)
    system: object | None = None
    think_time_s: float = 0.0
    cache_salt: str | None = None


class Fleet:
    """The router and its simulated workers (built inside a running VirtualLoop). `host`, called
    once, gives the StepHost every worker's steps run on (None: each worker a device of its own)."""

    def __init__(self, cfg: FleetConfig, host: Callable[[], StepHost] | None = None):
        self.cfg = cfg
        self.shape, self.device = load_shape(cfg.model), load_device(cfg.device).slowed(cfg.slowdown)
        self.link = load_link(cfg.link or self.device.inter_link)
        self.network = Network()
        self.index = MemoryIndex()
        self.view = MemoryIndexView(self.index, cfg.router.recent_route_ttl_s)
        self.router = Router(cfg.router, colocated=cfg.mode == "colocated", index=self.view)
        # The Picker draws the `random` policy from its own unseeded Random: seed it, so a
        # simulated run is the same every time (the router has no seed setting of its own).
        self.router.picker._rng.seed(cfg.seed)
        self.host = host() if host is not None else None
        self.workers: list[SimWorker] = []

    def _worker(self, worker_id: str, role: str, tp: int) -> SimWorker:
        cost = Roofline(self.shape, self.device, tp, load_link(self.device.intra_link) if tp > 1 else None)
        blocks = self.cfg.num_blocks or max(2, cost.kv_capacity_tokens(self.cfg.memory_fraction) // self.cfg.block_size)
        # A decode worker's own prefix cache changes none of its decisions (its blocks come with
        # the request, and cached blocks count as free): off, which spares hashing every prompt again.
        engine = SimEngine(role, self.cfg.scheduler, blocks, self.cfg.block_size, self.shape.name, cost,
                           prefix_cache=role != "decode", record_events=role != "decode")
        if (self.cfg.host_tier_bytes or self.cfg.disk_tier_bytes) and role != "decode":
            block_bytes = cost.kv_bytes(self.cfg.block_size)
            engine.attach_host(int(self.cfg.host_tier_bytes // block_bytes), block_bytes, load_link(self.cfg.host_link),
                               int(self.cfg.disk_tier_bytes // block_bytes), load_link(self.cfg.disk_link))
        return SimWorker(worker_id, role, engine, self.network, self.link, self.shape.name,
                         cost.kv_bytes(1), index=self.index if role != "decode" else None,
                         publish_delay_s=self.cfg.publish_delay_s, stream_every=self.cfg.stream_every,
                         tp_size=tp, host=self.host).start()

    async def start(self) -> None:
        c = self.cfg
        if c.mode == "colocated":
            specs = [(f"mixed-{i}", "mixed", c.prefill_tp) for i in range(c.prefill + c.decode)]
        else:
            specs = [(f"decode-{i}", "decode", c.decode_tp) for i in range(c.decode)]
            specs += [(f"prefill-{i}", "prefill", c.prefill_tp) for i in range(c.prefill)]
        for wid, role, tp in specs:
            w = self._worker(wid, role, tp)
            self.workers.append(w)
            await self.router.add_worker(w)

async def _session(router: Router, session: SimSession, t0: float) -> list[SimRecord]:
    history: list[int] = list(session.system) if session.system is not None else []
    records = []
    for k, (part, output_len) in enumerate(session.turns):
        if k and session.think_time_s:
            await asyncio.sleep(session.think_time_s)
        history += list(part)
        rid = f"{session.session_id}-t{k}" if len(session.turns) > 1 else session.session_id
        params = SamplingParams(max_tokens=output_len, ignore_eos=True)
        rec = await _request(router, GenerateRequest(rid, history, params, session.cache_salt), session.session_id,
                             k, t0)
        records.append(rec)
        if not rec.ok:
            break  # the next turn would need this answer
        history = history + [OUT_TOKEN] * rec.output_tokens
    return records


async def _request(router: Router, req: GenerateRequest, session_id: str, turn: int, t0: float) -> SimRecord:
    """One request through the router, timed client-side on the virtual clock."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    rec = SimRecord(req.request_id, session_id, turn, start_s=sent - t0, prompt_tokens=len(req.prompt_token_ids))
    try:
        async for chunk in router.generate(req):
            if chunk.token_ids:
                rec.chunk_times_s.append(loop.time() - sent)
                rec.chunk_tokens.append(len(chunk.token_ids))
            if chunk.usage is not None:
                rec.output_tokens, rec.cached_tokens = chunk.usage.completion_tokens, chunk.usage.cached_tokens
            if chunk.finished and chunk.timing is not None:
                rec.migrations = chunk.timing.migrations
    except Overloaded as exc:
        rec.error_kind, rec.error = "http_429", str(exc)
    except NoWorker as exc:
        rec.error_kind, rec.error = "http_503", str(exc)
    rec.e2e_s = loop.time() - sent
    if rec.ok:
        rec.output_tokens = rec.output_tokens or sum(rec.chunk_tokens)
        rec.ttft_s = rec.chunk_times_s[0] if rec.chunk_times_s else None
    return rec


async def _run(cfg: FleetConfig, sessions: list[SimSession],
               host: Callable[[], StepHost] | None) -> tuple[list[SimRecord], dict]:
    loop = asyncio.get_running_loop()
    fleet = Fleet(cfg, host)
    await fleet.start()
    t0 = loop.time()
    for worker_id, at_s in cfg.failures:
        if worker_id not in fleet.network.workers:
            raise ValueError(f"failure of unknown worker {worker_id!r}: the fleet has {sorted(fleet.network.workers)}")
        loop.call_at(t0 + at_s, fleet.network.workers[worker_id].kill)
    tasks = []
    for s in sorted(sessions, key=lambda s: s.arrival_s):  # each session's task starts when it arrives
        await asyncio.sleep(max(0.0, t0 + s.arrival_s - loop.time()))
        tasks.append(loop.create_task(_session(fleet.router, s, t0)))
    records = [r for done in await asyncio.gather(*tasks) for r in done]
    duration = loop.time() - t0
    net = fleet.network
    sent = {r.request_id: t0 + r.start_s for r in records}
    # Queueing: from send to the first step that computes the request (router admission,
    # decode reservation, the prefill worker's waiting queue), as a share of its TTFT.
    queue = {rid: net.scheduled_at[rid] - sent[rid] for rid in sent if rid in net.scheduled_at}
    stats = {w.worker_id: {**await w.stats(), "alive": w.alive} for w in fleet.workers}
    extra = {"duration_s": duration, "queue_s": queue, "workers": stats, "kv_picks": dict(fleet.router.picker.kv_picks)}
    return list(records), extra


def simulate(cfg: FleetConfig, sessions: list[SimSession], slo: dict[str, float] | None = None,
             host: Callable[[], StepHost] | None = None) -> dict:
    """One simulated run: its records (time-ordered), the summary (brigade bench's keys), and
    the simulator's own figures under "sim" (cluster/sim_bridge.py writes it as a bench result).
    `host`: what the workers' steps run on (Fleet); None, each worker on a device of its own."""
    wall = time.perf_counter()
    records, extra = run_virtual(_run(cfg, sessions, host))
    wall = time.perf_counter() - wall
    records.sort(key=lambda r: r.start_s)
    ttft = {r.request_id: r.ttft_s for r in records if r.ok and r.ttft_s}
    shares = [min(1.0, extra["queue_s"][rid] / t) for rid, t in ttft.items() if rid in extra["queue_s"]]
    busy = [w["busy_s"] / extra["duration_s"] for w in extra["workers"].values()] if extra["duration_s"] else []
    sim = {"wall_s": wall, "virtual_s": extra["duration_s"], "gpus": cfg.gpus,
           "mean_queue_share_of_ttft": sum(shares) / len(shares) if shares else 0.0,
           "p90_queue_ms": _pct([q * 1000 for q in extra["queue_s"].values()], 90),
           "mean_utilization": sum(busy) / len(busy) if busy else 0.0,
           "kv_picks": extra["kv_picks"], "workers": extra["workers"]}
    # bench's "server_steps" (loadtest/server_steps.py): here the whole run's, as a served run's
    steps = {wid: w.pop("step_times") for wid, w in extra["workers"].items() if "step_times" in w}
    return {**summarize(records, extra["duration_s"], slo), "duration": extra["duration_s"], "records": records,
            "server_steps": steps, "sim": sim, "fleet": cfg.model_dump(mode="json")}


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]
