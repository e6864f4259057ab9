"""What the cluster tests share (integration and chaos): the tiny-preset workload, the
cluster config they start from, and one request driven through the router or through the
plain workers."""
from __future__ import annotations

import asyncio
import random

from cluster.config import ClusterConfig
from decode_worker import DecodeWorker
from engine import SamplingParams
from engine.messages import Chunk, GenerateRequest, Timing
from prefill_worker import PrefillWorker

BS = 16  # the cluster's default block size
NUM_BLOCKS = 512
VOCAB = 4096  # the tiny preset's


def make_workload(n: int = 32, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    """`n` greedy requests: prompts of 1..~200 tokens (every fourth extends one shared 40-token
    prefix, so prefix caches hit), max_tokens 4..24."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    lengths = [1, 2, 15, 16, 17, 31, 33, 64, 100, 150, 199, 203] + [rng.randrange(1, 200) for _ in range(n - 12)]
    prompts = []
    for i, n_tokens in enumerate(lengths[:n]):
        tail = [rng.randrange(3, VOCAB) for _ in range(n_tokens)]
        prompts.append(shared + tail[: max(1, n_tokens - 40)] if i % 4 == 3 else tail)
    params = [SamplingParams(max_tokens=rng.randrange(4, 25), temperature=0.0, ignore_eos=True) for _ in prompts]
    return prompts, params


PROMPTS, PARAMS = make_workload()


def pool_whole(stats: dict) -> bool:
    return (stats["free_blocks"] == stats["num_blocks"] and stats["referenced_blocks"] == 0
            and stats["reserved"] == stats["prefilled"] == stats["running"] == stats["waiting"] == 0
            and stats.get("pinned_exports", 0) == 0)


def cluster_fields(num_blocks: int, **overrides) -> dict:
    """A test cluster's ClusterConfig fields: 2 CPUs (each worker runs one torch thread; the two
    cores are shared with everything), `num_blocks` KV blocks per worker, float32 weights, then
    `overrides` on top. A top-level key replaces that section, except `engine`: a dict there is
    merged onto dtype float32 (the tests compare tokens against float32 references and across
    batch compositions; `auto` picks bfloat16 on CPUs with bfloat16 instructions)."""
    engine = overrides.pop("engine", {"cache": {"num_blocks": num_blocks}})
    if isinstance(engine, dict):
        engine = {"dtype": "float32", **engine}
    return {"num_cpus": 2, **overrides, "engine": engine}


def cluster_config(**overrides) -> ClusterConfig:
    return ClusterConfig(**cluster_fields(NUM_BLOCKS, **overrides))


async def collect(router, rid: str, prompt: list[int], params: SamplingParams) -> tuple[list[int], Chunk]:
    """Stream one request through the router: (all tokens, the last chunk)."""
    tokens, last = [], None
    async for ref in router.generate.remote(GenerateRequest(rid, prompt, params)):
        last = await ref
        tokens += last.token_ids
    return tokens, last


def disaggregate(prefill: PrefillWorker, decode: DecodeWorker, rid: str, prompt: list[int],
                 params: SamplingParams) -> tuple[list[int], Timing]:
    """One request through the plain workers as the router drives them: reserve, prefill with
    the reservation's handle (the KV leaves as it is exported), then the decode worker's own
    stream (wait for the KV, admit, or recompute when the transfer fails).
    Returns (tokens, the transfer's timing)."""
    req = GenerateRequest(rid, prompt, params)
    handle = decode.reserve(rid, len(prompt), prefill.worker_id)
    assert handle is not None
    first = prefill.prefill(req, handle).result(timeout=30)

    async def stream() -> list[Chunk]:
        return [c async for c in decode.stream(req, first, handle)]

    chunks = asyncio.run(asyncio.wait_for(stream(), 60))
    assert chunks[-1].finished and chunks[0].timing is not None
    return [first.first_token_id, *(t for c in chunks for t in c.token_ids)], chunks[0].timing
