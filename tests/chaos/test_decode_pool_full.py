"""Chaos: more greedy streams than a disaggregated decode worker's KV pool holds (real local Ray,
a real redis-server, `tiny` preset, 1 prefill + 1 decode worker, the decode pool holding about
two streams). Requests wait in the router for decode blocks, in arrival order, instead of
being refused with 503 while the decode worker is merely full: every stream completes,
token-identical to an unloaded single-process run, and nothing leaks.

CI runs 8 streams; BRIGADE_CHAOS_FULL=1 runs 24 and writes the figure to benchmarks/results/chaos.json.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
from cluster_helpers import collect

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.extended]

from support import FULL  # noqa: E402  (tests/ is on the path: tests/conftest.py)

STREAMS = 24 if FULL else 8
VOCAB = 4096  # the tiny preset's
NUM_BLOCKS = 12  # per worker; one stream needs up to 7 blocks of 16 tokens, so about two decode at once
PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(ray_cluster, redis_server):
    # decode_wait_s: no refusal however loaded the machine is; the test asserts none happens.
    return ray_cluster(redis_server.url, mode="disaggregated", prefill=1, decode=1,
                       engine={"cache": {"num_blocks": NUM_BLOCKS}}, router={"decode_wait_s": 600.0})


@pytest.mark.timeout(720)
def test_streams_beyond_the_decode_pool_wait_for_blocks_and_all_complete_identical(cluster, chaos_figure):
    rng = random.Random(11)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(20, 40))] for _ in range(STREAMS)]
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=512)))
    reference = [o.token_ids for o in engine.generate(batch, [PARAMS] * len(batch))]

    async def main():
        return await asyncio.gather(*(collect(cluster.router, f"full{i}", p, PARAMS) for i, p in enumerate(batch)),
                                    return_exceptions=True)

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 660))
    seconds = time.monotonic() - t0
    refused = [r for r in results if isinstance(r, BaseException)]
    identical = sum(not isinstance(r, BaseException) and r[0] == reference[i] for i, r in enumerate(results))
    print(f"\ndecode pool full: {STREAMS} streams on a {NUM_BLOCKS}-block decode pool; {len(refused)} refused, "
          f"{identical}/{STREAMS} complete and identical, {seconds:.1f} s")
    chaos_figure("decode_pool_full", {"identical_fraction": identical / STREAMS, "refused": len(refused)},
                 {"identical_fraction": ">= 1.0", "refused": "== 0"},
                 streams=STREAMS, decode_num_blocks=NUM_BLOCKS, seconds=seconds)
    assert not refused, refused[:3]
    for i, (tokens, last) in enumerate(results):
        assert last.finish_reason == "length" and tokens == reference[i], f"stream {i}: {last.finish_reason}"
    for wid, s in cluster.stats().items():  # nothing leaked: every pool back to whole, no reservation held
        assert s["free_blocks"] == s["num_blocks"] and not s["running"] and not s["waiting"], (wid, s)
