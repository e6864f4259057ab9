"""One rank of a tensor/expert-parallel engine, run as its own process by the parallel tests.

Rank 0 generates greedily for the prompts (with top-5 logprobs) and writes the outputs as
JSON; the other ranks follow rank 0's broadcasts until it stops them. Arguments: one JSON
object (see tests/parallel_group.py).
"""
from __future__ import annotations

import json
import sys

import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.parallel import ParallelConfig


def main(args: dict) -> None:
    torch.set_num_threads(1)
    parallel = ParallelConfig(**args["parallel"])
    device = args.get("device", "cpu")
    if device == "cuda":  # one GPU per rank
        torch.cuda.set_device(parallel.rank)
        device = f"cuda:{parallel.rank}"
    engine = LLMEngine(EngineConfig(
        model=args["model"], dtype="float32", device=device, parallel=parallel,
        cache=CacheConfig(num_blocks=args.get("num_blocks", 128), block_size=4),
        scheduler=SchedulerConfig(max_num_batched_tokens=256),
    ))
    runner = engine.runner
    if parallel.rank != 0:
        if args.get("fail_local_kv"):
            runner.receive_local = _lost_transfer
        runner.follow()
        return
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True, logprobs=5)
    try:
        if args.get("fail_local_kv"):
            _expect_local_kv_failure(engine)
        outs = engine.generate(args["prompts"], params)
    finally:
        runner.stop_followers()
    result = [{"token_ids": o.token_ids,
               "logprobs": [[[tok, lp] for tok, lp in step.top] for step in o.logprobs]} for o in outs]
    with open(args["out"], "w") as f:
        json.dump(result, f)


def _lost_transfer(request_id: str, num_tokens: int, peer: str):
    raise ConnectionError(f"the pair carrying {request_id!r} closed")  # a follower's transfer failing


def _expect_local_kv_failure(engine: LLMEngine) -> None:
    """A follower whose rank-by-rank KV receive fails fails that request, not the group."""
    from engine.parallel.runner import LocalKVFailed

    blocks = engine.reserve("lost", 4)
    kv = torch.zeros((2, *engine.runner.kv_cache.shape[1:2], 1, *engine.runner.kv_cache.shape[3:]))
    try:
        engine.runner.write_local("lost", 4, blocks, kv)
    except LocalKVFailed as exc:
        assert "1 rank(s) failed to receive" in str(exc), exc
    else:
        raise AssertionError("write_local succeeded although a rank's receive failed")
    assert engine.runner.healthy
    engine.abort("lost")


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
