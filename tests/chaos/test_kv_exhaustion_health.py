"""Chaos: more greedy streams than the KV pools hold, Redis stopped under load, then a worker that
dies quietly (real local Ray, a real redis-server, `tiny` preset, one colocated cluster of 2 mixed
workers with tiny KV pools, routing by the KV index).

- KV exhaustion: every stream completes, token-identical to an unloaded single-process run, and
  the workers preempted (recompute) to get there.
- Redis down: streams started before Redis is stopped and while it is down all complete (routed
  by load alone); after a restart (empty, same port) the router's index is available again and
  both workers' leases are back.
- Health: a SIGKILLed worker with nothing in flight is found only by the router's health check;
  it is marked unhealthy within a few health intervals and no new request is routed to it.

CI runs 8 streams per test; BRIGADE_CHAOS_FULL=1 runs 32 and writes the figures to
benchmarks/results/chaos.json (tests/chaos/conftest.py). Each test prints its figure.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray
from cluster_helpers import collect
from helpers import tiny_model_id

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from router.index.query import PrefixIndex
from router.index.registry import connect

pytestmark = pytest.mark.usefixtures("torch_single_thread")

from support import FULL, wait_for  # noqa: E402  (tests/ is on the path: tests/conftest.py)

STREAMS = 32 if FULL else 8
VOCAB = 4096  # the tiny preset's
NUM_BLOCKS = 16  # per worker; one stream needs up to 7 blocks of 16 tokens
HEALTH_INTERVAL_S = 0.3
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster, redis_server):
    return ray_cluster(redis_server.url, mode="colocated", decode=2, engine={"cache": {"num_blocks": NUM_BLOCKS}},
                       index={"lease_ttl_s": 3.0, "key_prefix": f"chaos{random.randrange(1 << 30)}"},
                       router={"health_interval_s": HEALTH_INTERVAL_S})


def run(router, requests: list[tuple[str, list[int]]]) -> list:
    async def main():
        return await asyncio.gather(*(collect(router, rid, p, PARAMS) for rid, p in requests))
    return asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.timeout(180)
def test_more_streams_than_the_kv_pool_holds_all_complete_identical(cluster, chaos_figure):
    rng = random.Random(5)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 40))] for _ in range(STREAMS)]
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=512)))
    reference = [o.token_ids for o in engine.generate(batch, [PARAMS] * len(batch))]
    before = sum(s["preemptions"] for s in cluster.stats().values() if "error" not in s)
    t0 = time.monotonic()
    results = run(cluster.router, [(f"kv{i}", p) for i, p in enumerate(batch)])
    seconds = time.monotonic() - t0
    stats = {k: s for k, s in cluster.stats().items() if "error" not in s}
    preemptions = sum(s["preemptions"] for s in stats.values()) - before
    identical = sum(tokens == reference[i] for i, (tokens, _) in enumerate(results))
    print(f"\nkv exhaustion: {STREAMS} streams on 2 x {NUM_BLOCKS} blocks; {preemptions} preemptions, "
          f"{identical}/{STREAMS} complete and identical, {seconds:.1f} s")
    chaos_figure("kv_exhaustion", {"identical_fraction": identical / STREAMS}, {"identical_fraction": ">= 1.0"},
                 streams=STREAMS, num_blocks_per_worker=NUM_BLOCKS, preemptions=preemptions, identical=identical,
                 seconds=seconds)
    for i, (tokens, last) in enumerate(results):
        assert last.finish_reason == "length", f"stream {i}: {last.finish_reason}"
        assert tokens == reference[i], f"stream {i}: tokens differ from the unloaded run"
    assert preemptions > 0, stats
    for wid, s in stats.items():  # nothing leaked: every pool back to whole (cached blocks count as free)
        assert s["free_blocks"] == s["num_blocks"] and not s["running"] and not s["waiting"], (wid, s)


def index_available(cluster) -> bool:
    return ray.get(cluster.router.status.remote())["index"]["available"]


@pytest.mark.timeout(120)
def test_redis_stopped_under_load_loses_no_request_and_the_index_resyncs(cluster, redis_server, chaos_figure):
    rng = random.Random(7)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 40))] for _ in range(STREAMS)]
    assert index_available(cluster)

    async def main():
        first = [asyncio.create_task(collect(cluster.router, f"up{i}", p, PARAMS)) for i, p in enumerate(batch)]
        await asyncio.sleep(0.05)  # in flight when Redis goes
        await asyncio.to_thread(redis_server.stop)
        down = [asyncio.create_task(collect(cluster.router, f"down{i}", p, PARAMS)) for i, p in enumerate(batch)]
        return await asyncio.gather(*first, *down, return_exceptions=True)

    try:
        results = asyncio.run(asyncio.wait_for(main(), 120))
        errors = [r for r in results if isinstance(r, BaseException)]
        done = [r for r in results if not isinstance(r, BaseException) and r[1].finish_reason == "length"]
        # the router saw it go: the resync below is a real one
        wait_for(lambda: not index_available(cluster), 20, "the router noticing Redis was down", 0.05)
    finally:
        redis_server.start()  # empty, on the same port
    t0 = time.monotonic()
    index = PrefixIndex(connect(redis_server.url), cluster.cfg.index.key_prefix, tiny_model_id())
    wait_for(lambda: index_available(cluster) and len(index.live_epochs()) == len(cluster.workers), 30,
             "the index and every worker's lease back after Redis' restart", 0.05)
    resync_s = time.monotonic() - t0
    print(f"\nredis down: {len(results)} requests ({STREAMS} in flight at the stop, {STREAMS} sent while down), "
          f"{len(errors)} errors, {len(done)} complete; index and leases back {resync_s:.2f} s after restart")
    chaos_figure("redis_down", {"success_fraction": len(done) / len(results)}, {"success_fraction": ">= 1.0"},
                 requests=len(results), errors=len(errors), complete=len(done), resync_s=resync_s)
    assert not errors, errors[:3]
    assert len(done) == 2 * STREAMS


@pytest.mark.timeout(120)
def test_a_dead_worker_is_marked_unhealthy_and_gets_no_new_request(cluster, chaos_figure):
    workers = ray.get(cluster.router.status.remote())["workers"]
    assert all(w["healthy"] for w in workers.values()), workers
    victim = sorted(workers)[0]
    t0 = time.monotonic()
    ray.kill(cluster.workers[victim], no_restart=True)
    # a liveness bound, not a speed goal: the "not alive within 5 s", plus one check's period
    wait_for(lambda: not ray.get(cluster.router.status.remote())["workers"][victim]["healthy"],
             5 + HEALTH_INTERVAL_S, f"the router marking {victim} unhealthy after its death", 0.02)
    seconds = time.monotonic() - t0
    rng = random.Random(6)
    batch = [[rng.randrange(3, VOCAB) for _ in range(20)] for _ in range(4)]
    results = run(cluster.router, [(f"after{i}", p) for i, p in enumerate(batch)])
    served = {last.decode_worker for _, last in results}
    print(f"\nhealth: {victim} SIGKILLed, marked unhealthy after {seconds:.2f} s "
          f"(health interval {HEALTH_INTERVAL_S} s); {len(batch)} new requests served by {sorted(served)}")
    chaos_figure("dead_worker_health", {"detect_s": seconds}, {"detect_s": f"<= {5 + HEALTH_INTERVAL_S}"},
                 health_interval_s=HEALTH_INTERVAL_S, new_requests=len(batch), served_by=sorted(served))
    assert victim not in served and all(last.finish_reason == "length" for _, last in results)
    cluster.replace_worker(victim)
