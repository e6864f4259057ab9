"""Cancel at a random token, many times, over a real disaggregated cluster (local Ray, one prefill
and one decode worker paired over gloo): afterwards every worker's pool is back exactly at its
baseline and the router holds no request.

Half the cancellations call RouterActor.abort after a random number of tokens; the other half
leave the way a client does at either door: the ClusterBackend stream is closed (or its task
cancelled, for 0 tokens), which aborts the request. 0 tokens races the prefill, the reservation
and the KV pull. Four requests run at once so cancellations also land while others prefill or
transfer.
CI runs 40; BRIGADE_CHAOS_FULL=1 runs 1,000.
"""
from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
import ray
from cluster_helpers import pool_whole
from support import FULL, wait_for

from cluster.backend import ClusterBackend
from engine import SamplingParams
from engine.messages import GenerateRequest

RUNS = 1000 if FULL else 40
AT_ONCE = 4
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cluster(torch_single_thread, ray_cluster):
    return ray_cluster(prefill=1, decode=1)


async def _cancel_at(router, rid: str, prompt: list[int], at: int) -> tuple[int, str | None]:
    """Stream `rid`, aborting once `at` tokens arrived (at 0: right after submitting).
    (tokens received, finish reason)"""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, reason, aborted = 0, None, False

    async def abort() -> None:
        nonlocal aborted
        # abort() is False until the router has the request active; it may also finish first.
        while not aborted and reason is None:
            aborted = await router.abort.remote(rid)
            await asyncio.sleep(0.005)

    pending = asyncio.create_task(abort()) if at == 0 else None
    async for ref in router.generate.remote(GenerateRequest(rid, prompt, params)):
        chunk = await ref
        tokens += len(chunk.token_ids)
        if chunk.finished:
            reason = chunk.finish_reason
        elif pending is None and tokens >= at:
            pending = asyncio.create_task(abort())
    if pending is not None:
        await pending
    return tokens, reason


async def _leave_at(backend: ClusterBackend, rid: str, prompt: list[int], at: int) -> tuple[int, str | None]:
    """Stream `rid` through the doors' backend and leave once `at` tokens arrived (at 0: cancel
    the reading task right after submitting). (tokens received, "abort" when it left early)"""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokens, reason = 0, None

    async def read() -> None:
        nonlocal tokens, reason
        stream = backend.generate(GenerateRequest(rid, prompt, params))
        try:
            async for chunk in stream:
                tokens += len(chunk.token_ids)
                if chunk.finished:
                    reason = chunk.finish_reason
                elif at and tokens >= at:
                    reason = "abort"
                    return
        finally:
            await stream.aclose()  # what the HTTP door does when its client hangs up

    task = asyncio.create_task(read())
    if at == 0:
        await asyncio.sleep(0.01)
        task.cancel()
        reason = reason or "abort"
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return tokens, reason


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(3, 4096) for _ in range(rng.randrange(1, 120))]


@pytest.mark.timeout(900)
def test_cancel_at_a_random_token_leaks_nothing(cluster, chaos_figure) -> None:
    rng = random.Random(10)
    baseline = cluster.stats()
    assert all(pool_whole(s) for s in baseline.values()), baseline
    backend = ClusterBackend(cluster.cfg)
    backend.attach(cluster)

    async def main() -> list[tuple[int, str | None]]:
        out = []
        for start in range(0, RUNS, AT_ONCE):
            jobs = [(_cancel_at(cluster.router, f"cancel-{i}", _prompt(rng), rng.randrange(0, MAX_TOKENS)) if i % 2
                     else _leave_at(backend, f"leave-{i}", _prompt(rng), rng.randrange(0, MAX_TOKENS)))
                    for i in range(start, min(RUNS, start + AT_ONCE))]
            out += await asyncio.gather(*jobs)
        return out

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 60 + RUNS * 2))
    aborted = sum(reason == "abort" for _, reason in results)
    assert all(reason in ("abort", "length") for _, reason in results), results
    assert aborted >= RUNS // 2  # most aborts land before max_tokens: the test really cancels

    def settled():
        stats = cluster.stats()
        return stats if all(pool_whole(s) and s["free_blocks"] == baseline[w]["free_blocks"]
                            for w, s in stats.items()) else None
    after = wait_for(settled, 10.0, lambda: f"every pool back at its baseline {baseline}; now {cluster.stats()}, "
                                            f"router {ray.get(cluster.router.status.remote(), timeout=30)}")
    status = ray.get(cluster.router.status.remote(), timeout=30)
    leaked = {w: baseline[w]["free_blocks"] - s["free_blocks"] for w, s in after.items()}
    print(f"\n{RUNS} requests, {aborted} cancelled mid-way, in {time.monotonic() - t0:.1f} s: leaked blocks {leaked}, "
          f"router running {status['running']}, waiting {status['waiting']}")
    chaos_figure("cancel_leaks", {"leaked_blocks": sum(leaked.values())}, {"leaked_blocks": "<= 0"},
                 requests=RUNS, cancelled=aborted, leaked=leaked, seconds=time.monotonic() - t0)
    assert status["running"] == status["waiting"] == 0
    assert all(w["inflight"] == 0 and w["queued_tokens"] == 0 for w in status["workers"].values()), status
