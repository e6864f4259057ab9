"""Poison detection: a request whose engine died under it is migrated at most once
more; if that engine dies too, the request fails for good with a clear error instead of moving
on to kill the next worker. A worker lost another way (process, node) migrates as before. The
router over plain async fakes of WorkerClient (no Ray)."""
from __future__ import annotations

import asyncio

import pytest
from ray.exceptions import RayActorError
from worker_fakes import FakeWorker, router_over

from engine.engine_loop import EngineDied
from engine.messages import Chunk, GenerateRequest
from engine.outputs import Usage
from engine.sampling import SamplingParams
from router.config import RouterConfig
from router.errors import PoisonRequest, StreamBroken, WorkerLost
from router.http.answers import api_error
from router.workers import lost

PROMPT = [5, 6, 7, 8]


class Mixed(FakeWorker):
    """Streams `max_tokens` tokens one a chunk; with `dies`, its engine (or, with
    engine=False, its process) is lost after the first chunk."""

    def __init__(self, worker_id: str, dies: bool = False, engine: bool = True):
        super().__init__(worker_id, "mixed")
        self.dies, self.engine = dies, engine

    async def generate(self, req: GenerateRequest, first=None, prefill=None):
        self.requests.append(req)
        yield Chunk(req.request_id, [1], "a")
        if self.dies:
            raise WorkerLost(self.worker_id, engine_died=self.engine)
        n = req.params.max_tokens - 1
        for _ in range(n - 1):
            yield Chunk(req.request_id, [2], "b")
        yield Chunk(req.request_id, [3], "c", True, "length", Usage(len(req.prompt_token_ids), n, 0))


async def run(router, rid: str = "p") -> list[Chunk]:
    req = GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=6, temperature=0.0))
    return [c async for c in router.generate(req)]


def test_a_request_two_engines_died_under_is_failed_for_good() -> None:
    workers = [Mixed(f"mixed-{i}", dies=True) for i in range(3)]  # each engine it reaches dies
    router = router_over(RouterConfig(policy="round_robin", max_migrations=5), *workers)
    with pytest.raises(PoisonRequest, match="two engine failures in a row") as info:
        asyncio.run(run(router))
    fed = [w.worker_id for w in workers if w.requests]
    assert len(fed) == 2 and all(w in str(info.value) for w in fed)  # no third engine was fed it
    answer = api_error(info.value)
    assert answer.status == 500 and "not tried again" in str(answer)
    assert router.admission.running == 0


def test_one_engine_death_migrates_once_and_the_request_completes() -> None:
    workers = [Mixed("mixed-0", dies=True), Mixed("mixed-1")]
    router = router_over(RouterConfig(policy="round_robin", max_migrations=2), *workers)
    chunks = asyncio.run(run(router))
    assert chunks[-1].finished and chunks[-1].timing.migrations == 1
    assert sum(len(c.token_ids) for c in chunks) == 6


def test_workers_lost_otherwise_migrate_up_to_max_migrations() -> None:
    """Three processes lost (not engines): the request moves twice (max_migrations), then ends
    retriable, as before; losing a process says nothing about the request."""
    workers = [Mixed(f"mixed-{i}", dies=True, engine=False) for i in range(3)]
    router = router_over(RouterConfig(policy="round_robin", max_migrations=2), *workers)
    with pytest.raises(StreamBroken, match="max_migrations"):
        asyncio.run(run(router))
    assert all(w.requests for w in workers)


def test_the_ray_worker_client_tells_an_engine_death_from_a_lost_process() -> None:
    assert lost("w", EngineDied("engine failed: RuntimeError('x')")).engine_died
    assert not lost("w", RayActorError()).engine_died
