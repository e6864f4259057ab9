"""A simulated worker behind the router's `WorkerClient` seam (router/workers.py).

Each worker runs its SimEngine in a loop on the virtual clock: plan a step (the real
scheduler), run it on its host (`StepHost`: by default a device of its own, where a step
takes its modelled time), finish it, wake whoever waits on its sequences. A reservation waits
for the step in flight, as the real decode worker's does. Its cache events reach the in-memory
index `publish_delay_s` later (the real publisher batches them). A decode worker pulls a
request's KV from its prefill worker over the configured link (bytes / bandwidth + latency),
then admits it into the blocks it reserved. `kill()` makes a worker die as a Ray actor does:
its calls raise WorkerLost and the router migrates the requests (a KV pull from a dead prefill
worker migrates too, where a real decode worker would recompute the prompt itself).

`Network` is what connects simulated workers: it knows them by id, so a prefill worker's
`connect` and a decode worker's pull find each other, and it records when each request was
first scheduled (the end of its queueing) for the simulator's report.
"""
from __future__ import annotations

import asyncio
import bisect
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.messages import Aborted, Chunk, GenerateRequest, KVHandle, PrefillResult, Timing, WorkerHealth
from engine.outputs import Usage
from engine.sequence import Sequence, SequenceStatus
from router.errors import WorkerLost
from sim.engine import OUT_TOKEN, SimEngine
from sim.hardware import LinkProfile
from sim.index import MemoryIndex


class StepHost(Protocol):
    """Where a worker's steps run. `steady`: a step's time is its own, so a steady decode batch
    may be advanced several steps at once (a host whose steps slow each other says False)."""

    steady: bool

    async def step(self, seconds: float, *, prompt: bool, decode: int) -> None:
        """Run one step of `seconds` modelled time (computing prompt tokens or not, with
        `decode` sequences decoding); return when it is done on the virtual clock."""


class DedicatedDevice:
    """Each worker on devices of its own: a step takes its modelled time."""

    steady = True

    async def step(self, seconds: float, *, prompt: bool, decode: int) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Network:
    workers: dict[str, SimWorker] = field(default_factory=dict)
    scheduled_at: dict[str, float] = field(default_factory=dict)  # request id -> first scheduled (prefill side)


class _Stream:
    """One request's progress as its worker's loop reports it."""

    def __init__(self) -> None:
        self.changed = asyncio.Event()
        self.sent = 0  # tokens already handed to the router
        self.first: asyncio.Future | None = None  # prefill role: set on the first token


class SimWorker:
    def __init__(self, worker_id: str, role: str, engine: SimEngine, network: Network, link: LinkProfile,
                 model_id: str, kv_bytes_per_token: int, index: MemoryIndex | None = None,
                 publish_delay_s: float = 0.05, stream_every: int = 16, tp_size: int = 1,
                 host: StepHost | None = None):
        self.worker_id, self.role, self.engine, self.network, self.link = worker_id, role, engine, network, link
        self.model_id, self.kv_bytes_per_token = model_id, kv_bytes_per_token
        self.index, self.publish_delay_s = index, publish_delay_s
        self.stream_every, self.tp_size = max(1, stream_every), tp_size
        self.host = host if host is not None else DedicatedDevice()
        self.busy_s = 0.0
        self.steps = 0
        self.transferred_bytes = 0
        self._streams: dict[str, _Stream] = {}
        self._accepts: asyncio.Queue[str] = asyncio.Queue()
        self._wake = asyncio.Event()
        self._between = asyncio.Event()  # set while no step is in flight
        self._between.set()
        self._loop_task: asyncio.Task | None = None
        self.alive = True
        network.workers[worker_id] = self

    def start(self) -> SimWorker:
        self._loop_task = asyncio.get_running_loop().create_task(self._run())
        return self

    # -- the engine loop ----------------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch, seconds = self.engine.plan()
            if not batch:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            for s in batch:
                self.network.scheduled_at.setdefault(s.seq.request_id, now)
            self._between.clear()
            steady = self.engine.steady_steps(batch, self.stream_every) if self.host.steady else []
            prompt = sum(s.seq.num_computed < s.seq.num_prompt_tokens for s in batch)
            if steady:
                repeats = await self._steady(steady)
                took = alone = sum(steady[:repeats])
            else:
                repeats = 1
                await self.host.step(seconds, prompt=prompt > 0, decode=len(batch) - prompt)
                took, alone = loop.time() - now, seconds
                self.busy_s += took
            self.engine.step_log.record(prompt > 0, len(batch) - prompt, took, alone, repeats)
            self.steps += repeats
            for seq in self.engine.finish(batch, repeats):
                self._progress(seq)
            self._between.set()
            if self.index is not None:
                events = self.engine.take_events()
                if events:
                    loop.call_later(self.publish_delay_s, self.index.apply, self.worker_id, events)

    async def _steady(self, step_s: list[float]) -> int:
        """Run repeats of a steady decode batch until new work arrives (which the next
        planned step takes, as after any step) or all are done; how many ran."""
        loop = asyncio.get_running_loop()
        start, ends, t = loop.time(), [], 0.0
        for dt in step_s:
            t += dt
            ends.append(t)
        self._wake.clear()
        timer = loop.call_later(t, self._wake.set)
        await self._wake.wait()
        timer.cancel()
        elapsed = loop.time() - start
        done = bisect.bisect_right(ends, elapsed + 1e-12)
        if done < len(ends):  # the step under way completes first
            await asyncio.sleep(ends[done] - elapsed)
            done += 1
        done = max(1, done)
        self.busy_s += ends[done - 1]
        return done

    def _progress(self, seq: Sequence) -> None:
        stream = self._streams.get(seq.request_id)
        if stream is None:
            return
        if stream.first is not None:
            if not stream.first.done():
                stream.first.set_result(seq)
            return
        new = len(seq.output_token_ids) - stream.sent
        if seq.status == SequenceStatus.FINISHED or new >= self.stream_every or stream.sent == 0:
            stream.changed.set()

    def _poke(self) -> None:
        self._wake.set()

    def kill(self) -> None:
        """The worker dies (a crash, a lost node): every call in flight and every later one
        raises WorkerLost, as RayWorker does for a dead actor, so the router migrates."""
        self.alive = False
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._between.set()  # a reservation waiting for the step in flight learns of the death
        for stream in self._streams.values():
            if stream.first is not None and not stream.first.done():
                stream.first.set_exception(WorkerLost(self.worker_id))
            stream.changed.set()

    def _check(self) -> None:
        if not self.alive:
            raise WorkerLost(self.worker_id)

    # -- WorkerClient -------------------------------------------------------------------
    async def health(self) -> WorkerHealth:
        self._check()
        return WorkerHealth(self.worker_id, self.role, True, model_id=self.model_id,
                            block_size=self.engine.block_size, free_blocks=self.engine.pool.num_free,
                            running=len(self.engine.scheduler.running), tp_size=self.tp_size)

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        """As the real decode worker, the reservation runs on the engine's loop between steps:
        it waits for the step in flight (a steady run of them ends after the current one)."""
        self._check()
        if not self._between.is_set():
            self._poke()
            await self._between.wait()
            self._check()
        if not self.engine.reserve(request_id, num_tokens):
            return None
        return KVHandle(request_id, prefill_id, self.worker_id, num_tokens)

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        self._check()
        loop = asyncio.get_running_loop()
        arrived = loop.time()
        stream = self._streams[req.request_id] = _Stream()
        stream.first = loop.create_future()
        seq = self.engine.add(req)
        self._poke()
        try:
            await stream.first
        finally:
            self._streams.pop(req.request_id, None)
        if seq.finish_reason == "abort":
            raise Aborted(req.request_id)
        started = self.network.scheduled_at.get(req.request_id, arrived)
        usage = Usage(seq.num_prompt_tokens, 1, seq.num_cached_tokens or 0)
        return PrefillResult(req.request_id, OUT_TOKEN, "", seq.is_finished, seq.finish_reason, usage, None,
                             queue_s=started - arrived, prefill_s=loop.time() - started)

    async def generate(self, req: GenerateRequest, first: PrefillResult | None = None,
                       handle: KVHandle | None = None) -> AsyncIterator[Chunk]:
        self._check()
        rid = req.request_id
        stream = self._streams[rid] = _Stream()
        try:
            timing = None
            if first is None:
                seq = self.engine.add(req)
            else:
                start = asyncio.get_running_loop().time()
                nbytes = await self.network.workers[handle.prefill_id].send_kv(rid)
                timing = Timing(transfer_s=asyncio.get_running_loop().time() - start, transfer_bytes=nbytes)
                if rid not in self.engine.reservations:  # aborted while the KV was on its way
                    yield Chunk(rid, [], "", True, "abort")
                    return
                seq = self.engine.admit(req, first.first_token_id, first.usage.cached_tokens)
                stream.sent = 1  # the prefill worker's chunk carried the first token
                if seq is None:
                    yield Chunk(rid, [], "", True, first.finish_reason or "length", first.usage, timing=timing)
                    return
            self._poke()
            while True:
                await stream.changed.wait()
                stream.changed.clear()
                self._check()
                out = seq.output_token_ids
                new = len(out) - stream.sent
                stream.sent = len(out)
                done = seq.status == SequenceStatus.FINISHED
                usage = Usage(seq.num_prompt_tokens, len(out), seq.num_cached_tokens or 0) if done else None
                if new or done:
                    yield Chunk(rid, [OUT_TOKEN] * new, "", done, seq.finish_reason if done else None, usage,
                                timing=timing)
                    timing = None
                if done:
                    return
        finally:
            self._streams.pop(rid, None)
            if self.alive:
                self.engine.release(rid)  # a reservation the request never used (its prefill worker died)

    async def send_kv(self, request_id: str) -> int:
        """Prefill side of a pull: the KV crosses the link, then its blocks are free here."""
        self._check()
        seq = self.engine.prefilled.get(request_id)
        if seq is None:
            return 0
        nbytes = self.kv_bytes_per_token * seq.num_computed
        await asyncio.sleep(self.link.transfer_s(nbytes))
        self._check()  # died while sending
        self.transferred_bytes += nbytes
        self.engine.release(request_id)
        self._poke()
        return nbytes

    async def abort(self, request_id: str) -> None:
        stream, seq = self._streams.get(request_id), self.engine.seqs.get(request_id)
        if self.engine.abort(request_id) and stream is not None:
            if stream.first is not None and not stream.first.done():
                stream.first.set_result(seq)
            stream.changed.set()
        self._poke()

    async def address(self) -> tuple[str, int]:
        self._check()
        return (self.worker_id, 0)

    async def accept(self, ticket: str, expect: str | None = None) -> str:
        return await self._accepts.get()

    async def connect(self, decode_id: str, address, ticket: str) -> None:
        self._check()
        self.network.workers[decode_id]._accepts.put_nowait(self.worker_id)

    async def disconnect(self, peer_id: str) -> None:
        return None

    async def stats(self) -> dict:
        return {**self.engine.stats(), "busy_s": self.busy_s, "steps": self.steps,
                "transferred_bytes": self.transferred_bytes}
