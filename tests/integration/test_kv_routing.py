"""KV-aware routing end to end: real Ray, a real redis-server, the `tiny` preset.

One module-scoped Redis and Ray; a disaggregated cluster (2 prefill + 1 decode) whose
workers publish to the index, then a colocated one (2 mixed workers) shared by two routers.
"""
from __future__ import annotations

import asyncio
import random

import pytest
import ray
from helpers import tiny_model_id
from support import wait_for

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.messages import Chunk, GenerateRequest
from router.actor import RouterActor
from router.index.query import PrefixIndex
from router.index.registry import connect

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.timeout(300)]

BS = 16
rng = random.Random(7)
SHARED = [[rng.randrange(3, 4096) for _ in range(160)] for _ in range(4)]  # 10 blocks each
FIRST = [s + [rng.randrange(3, 4096) for _ in range(20)] for s in SHARED]
SECOND = [s + [rng.randrange(3, 4096) for _ in range(30)] for s in SHARED]
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cold() -> dict[str, list[int]]:
    """Every prompt's tokens from one cold engine in this process, no prefix cache."""
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=256, enable_prefix_cache=False)))
    outs = engine.generate(FIRST + SECOND, PARAMS)
    rids = [f"a{i}" for i in range(len(FIRST))] + [f"b{i}" for i in range(len(SECOND))]
    return {rid: o.token_ids for rid, o in zip(rids, outs)}


def config(**overrides) -> dict:
    """ray_cluster overrides: small pools, a short lease, a fresh key prefix, quick health checks."""
    return {"engine": {"cache": {"num_blocks": 256}},
            "index": {"lease_ttl_s": 3.0, "key_prefix": f"kv{rng.randrange(1 << 30)}"},
            "router": {"health_interval_s": 0.3}, **overrides}


async def collect(router, rid: str, prompt: list[int], salt: str | None = None) -> tuple[list[int], Chunk]:
    tokens, last = [], None
    async for ref in router.generate.remote(GenerateRequest(rid, prompt, PARAMS, cache_salt=salt)):
        last = await ref
        tokens += last.token_ids
    return tokens, last


def run(router, requests: list[tuple[str, list[int]]], salt: str | None = None) -> dict[str, tuple[list[int], Chunk]]:
    async def main():
        return await asyncio.gather(*(collect(router, rid, p, salt) for rid, p in requests))
    return dict(zip([r for r, _ in requests], asyncio.run(asyncio.wait_for(main(), 120))))




def indexed(index: PrefixIndex, prompt: list[int], worker: str, salt: str | None = None) -> bool:
    from engine.block_hash import chain_hashes, salted_root

    hashes = chain_hashes(prompt[:160], BS, tiny_model_id(), parent=salted_root(salt))
    hit = index.query(hashes, index.live_epochs()).get(worker)
    return hit is not None and hit.blocks == 10


@pytest.fixture(scope="module")
def disagg(ray_cluster, redis_server):
    return ray_cluster(redis_server.url, **config(prefill=2, decode=1))


def test_a_shared_prefix_goes_back_to_its_prefill_worker(disagg, redis_server, cold):
    index = PrefixIndex(connect(redis_server.url), disagg.cfg.index.key_prefix, tiny_model_id())
    assert sorted(index.live_epochs()) == ["decode-0", "prefill-0", "prefill-1"]  # the workers' own leases
    first = run(disagg.router, [(f"a{i}", p) for i, p in enumerate(FIRST)])  # at once: they spread by load
    homes = {rid: last.prefill_worker for rid, (_, last) in first.items()}
    assert set(homes.values()) == {"prefill-0", "prefill-1"}
    for rid, (tokens, _) in first.items():
        assert tokens == cold[rid]
    for i in range(len(FIRST)):
        wait_for(lambda i=i: indexed(index, FIRST[i], homes[f"a{i}"]), what=f"a{i}'s blocks in the index")
    second = run(disagg.router, [(f"b{i}", p) for i, p in enumerate(SECOND)])
    for i in range(len(SECOND)):
        tokens, last = second[f"b{i}"]
        assert last.prefill_worker == homes[f"a{i}"], f"b{i}"
        assert last.usage.cached_tokens == 160 and last.usage.cached_by_tier.get("device", 160) == 160
        assert tokens == cold[f"b{i}"]  # the same tokens as a cold run
    status = ray.get(disagg.router.status.remote())
    assert status["policy"] == "kv_aware" and status["index"]["available"]


def test_a_salted_request_gets_no_other_tenants_blocks(disagg, cold):
    tokens, last = run(disagg.router, [("salted", SECOND[0])], salt="acme")["salted"]
    assert last.usage.cached_tokens == 0
    assert tokens == cold["b0"]


def test_redis_restart_mid_run_requests_keep_succeeding_and_the_index_recovers(disagg, redis_server, cold):
    redis_server.stop()
    try:
        out = run(disagg.router, [("down0", FIRST[1]), ("down1", SECOND[2])])  # routed by load alone
        assert out["down0"][0] == cold["a1"] and out["down1"][0] == cold["b2"]
        wait_for(lambda: not ray.get(disagg.router.status.remote())["index"]["available"], what="index down")
    finally:
        redis_server.start()  # empty, on the same port
    wait_for(lambda: ray.get(disagg.router.status.remote())["index"]["available"], what="index back")
    index = PrefixIndex(connect(redis_server.url), disagg.cfg.index.key_prefix, tiny_model_id())
    wait_for(lambda: sorted(index.live_epochs()) == ["decode-0", "prefill-0", "prefill-1"], what="leases back")
    home = run(disagg.router, [("after0", FIRST[3])])["after0"][1].prefill_worker
    wait_for(lambda: indexed(index, FIRST[3], home), what="blocks re-published")
    picks = ray.get(disagg.router.status.remote())["kv_picks"]
    tokens, last = run(disagg.router, [("after1", SECOND[3])])["after1"]
    assert tokens == cold["b3"]
    now = ray.get(disagg.router.status.remote())["kv_picks"]
    assert now["by_index"] == picks["by_index"] + 1  # routed by the recovered index
    # To a worker with the longest hit (home, or another that holds the prefix too: requests
    # routed by load while Redis was down may have put it there), unless load outweighed it.
    if now["load_over_hit"] == picks["load_over_hit"]:
        assert last.usage.cached_tokens >= 160, (last.prefill_worker, home)  # b3 ran there too: maybe 176


def test_two_routers_share_one_index(ray_cluster, redis_server, cold):
    cl = ray_cluster(redis_server.url, **config(mode="colocated", decode=2))
    try:
        other = RouterActor.options(num_cpus=0, max_concurrency=100).remote(cl.cfg.router, True, cl.index)
        for wid, handle in cl.workers.items():
            ray.get(other.add_worker.remote("mixed", wid, handle))
        index = PrefixIndex(connect(redis_server.url), cl.cfg.index.key_prefix, tiny_model_id())
        first = run(cl.router, [("a0", FIRST[0]), ("a1", FIRST[1])])  # at once: one on each worker
        homes = {i: first[f"a{i}"][1].decode_worker for i in (0, 1)}
        assert set(homes.values()) == {"mixed-0", "mixed-1"}
        for i in (0, 1):
            wait_for(lambda i=i: indexed(index, FIRST[i], homes[i]), what="blocks indexed")
        for i in (0, 1):
            tokens, last = run(other, [(f"b{i}", SECOND[i])])[f"b{i}"]
            assert last.decode_worker == homes[i] and last.usage.cached_tokens == 160
            assert tokens == cold[f"b{i}"]
        ray.kill(other)
    finally:
        cl.shutdown()
