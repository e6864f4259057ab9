"""Speculative decoding in a disaggregated cluster (real Ray, real gloo, the `tiny` preset).

The prefill worker never speculates; the decode worker receives the target's KV and first
token. With speculative.draft_kv "ship" the prefill worker's draft also computes the prompt's
draft KV and it comes over the same channel; with "recompute" the decode worker's draft model
prefills the prompt itself on the request's first decode step. Greedy tokens must equal the
plain single-process engine's, and every pool (target and draft, on both workers) must be
whole afterwards.
"""
from __future__ import annotations

import asyncio

import pytest
from cluster_helpers import NUM_BLOCKS, PARAMS, PROMPTS, collect, pool_whole
from support import wait_for

from engine import CacheConfig, EngineConfig, LLMEngine

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.extended]

# The target drafting for itself: every greedy proposal is accepted, so accepted runs (and
# their rollback at max_tokens) happen on every request.
SPEC = {"method": "draft", "draft_model": "tiny", "k": 3}


def draft_pool_whole(stats: dict) -> bool:
    return ("draft_num_blocks" not in stats or
            (stats["draft_free_blocks"] == stats["draft_num_blocks"] and stats["draft_referenced_blocks"] == 0
             and stats["draft_requests"] == 0))


BLOCK = 16  # the cluster's KV block size (the default)


def least_prompt_work(prompts: list[list[int]], block_size: int) -> int:
    """The fewest prompt tokens a model with a prefix cache computes for these prompts, in any
    order: each distinct full block once, each prompt's partial tail, less the last token (its
    logits come with the first proposal). A request's draft catches up on its prompt within the
    step's budget and only proposes once it has, so one that finished first may never need it."""
    blocks = {tuple(p[:(b + 1) * block_size]) for p in prompts for b in range(len(p) // block_size)}
    return block_size * len(blocks) + sum(len(p) % block_size for p in prompts) - len(prompts)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("draft_kv", ["ship", "recompute"])
def test_disaggregated_speculation_gives_the_engines_tokens(ray_cluster, draft_kv):
    ids = list(range(0, len(PROMPTS), 2))
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    want = [o.token_ids for o in engine.generate([PROMPTS[i] for i in ids], [PARAMS[i] for i in ids])]
    cluster = ray_cluster(prefill=1, decode=1, engine={"cache": {"num_blocks": NUM_BLOCKS},
                                                       "speculative": SPEC | {"draft_kv": draft_kv}})

    async def main():
        return await asyncio.gather(*(collect(cluster.router, f"spec-{i}", PROMPTS[i], PARAMS[i]) for i in ids))

    results = asyncio.run(asyncio.wait_for(main(), 180))
    for i, expected, (tokens, last) in zip(ids, want, results):
        assert tokens == expected, f"request {i}"
        assert (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
        assert last.finish_reason == "length" and last.usage.completion_tokens == PARAMS[i].max_tokens
    assert sum(last.usage.spec_accepted_tokens for _, last in results) > 0

    def whole():
        stats = cluster.stats()
        return stats if all(pool_whole(s) and draft_pool_whole(s) for s in stats.values()) else None
    stats = wait_for(whole, 10, "every pool whole, the draft's too")
    assert "draft_num_blocks" in stats["decode-0"]
    # The prefill worker has a draft model only to ship its KV; the decode worker's then runs no prompt.
    assert ("draft_num_blocks" in stats["prefill-0"]) == (draft_kv == "ship")
    prompt_tokens = sum(len(PROMPTS[i]) for i in ids)
    if draft_kv == "ship":
        assert 0 < stats["prefill-0"]["draft_computed_tokens"] <= prompt_tokens
        assert stats["decode-0"]["draft_computed_tokens"] < prompt_tokens  # proposals only
    else:  # its draft computed the prompt of every request that proposed (less its own prefix cache's hits)
        proposed = [PROMPTS[i] for i, (_, last) in zip(ids, results) if last.usage.spec_draft_tokens]
        assert proposed and stats["decode-0"]["draft_computed_tokens"] >= least_prompt_work(proposed, BLOCK)
    cluster.shutdown()
