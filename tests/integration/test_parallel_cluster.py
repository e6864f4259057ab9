"""A prefill worker and a decode worker of TP size 2 each (two Ray actors in a placement group
per worker) behind the real router, over real gloo pairs: tokens equal the single-process
engine's, also after a corrupted KV piece. Killing a rank of a decode group is in the chaos
suite (tests/chaos/test_tp_rank_kill.py).
"""
from __future__ import annotations

import asyncio

import pytest
import ray
from cluster_helpers import BS, NUM_BLOCKS, PARAMS, PROMPTS, collect

from engine import CacheConfig, EngineConfig, LLMEngine
from engine.model_config import ModelConfig
from engine.presets import resolve_model

pytestmark = pytest.mark.usefixtures("torch_single_thread")
IDS = [0, 2, 5, 7, 11]  # prompts of 1, 15, 31, 64 and 203 tokens


@pytest.fixture(scope="module")
def group_cluster(ray_cluster):
    return ray_cluster(num_cpus=3, engine={"cache": {"num_blocks": NUM_BLOCKS}},
                       parallel={"prefill_tp": 2, "decode_tp": 2, "timeout_s": 10.0})


def block_bytes() -> int:
    cfg = ModelConfig.from_dir(resolve_model("tiny"))
    return 2 * cfg.num_layers * BS * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32


def expected() -> list[list[int]]:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    return [o.token_ids for o in engine.generate([PROMPTS[i] for i in IDS], [PARAMS[i] for i in IDS])]


def run(cluster, ids: list[int], tag: str) -> list:
    async def main():
        return await asyncio.gather(*(collect(cluster.router, f"{tag}-{i}", PROMPTS[i], PARAMS[i]) for i in ids))
    return asyncio.run(asyncio.wait_for(main(), 120))


@pytest.mark.timeout(240)
def test_decode_tp2_group_gives_the_engines_tokens(group_cluster):
    assert sorted(group_cluster.workers) == ["decode-0", "prefill-0"]
    for worker in ("decode-0", "prefill-0"):
        assert len(group_cluster.groups[worker].ranks) == 1
        health = ray.get(group_cluster.workers[worker].health.remote(), timeout=10)
        assert health.alive and health.tp_size == 2
    results = run(group_cluster, IDS, "tp2")
    assert [tokens for tokens, _ in results] == expected()
    assert all(last.decode_worker == "decode-0" and not last.timing.recomputed for _, last in results)
    # Rank 0's pair carried only rank 0's KV heads (1 of the tiny preset's 2): half of each block.
    for i, (_, last) in zip(IDS, results):
        assert last.timing.transfer_bytes == -(-len(PROMPTS[i]) // BS) * block_bytes() // 2


@pytest.mark.timeout(120)
def test_a_corrupted_piece_is_recomputed_and_every_ranks_pair_stays_in_step(group_cluster):
    """Rank 0's piece arrives corrupted: rank 1 still takes its piece, the request is recomputed
    with the same tokens, and the next request transfers normally on both ranks' pairs."""
    want = dict(zip(IDS, expected()))
    ray.get(group_cluster.workers["prefill-0"].corrupt_next_payload.remote("decode-0"), timeout=10)
    [(tokens, last)] = run(group_cluster, [IDS[2]], "corrupt")
    assert tokens == want[IDS[2]] and last.timing.recomputed
    [(tokens, last)] = run(group_cluster, [IDS[3]], "after-corrupt")
    assert tokens == want[IDS[3]] and not last.timing.recomputed and last.timing.transfer_bytes > 0
