"""Build one rank's model runner: the plan, the group, the sharded weights, an agreed pool size."""
from __future__ import annotations

from pathlib import Path

import torch

from engine.config import CacheConfig
from engine.model_config import ModelConfig
from engine.model_runner import kv_cache_blocks
from engine.models.layers import pack_linears_for_cpu
from engine.parallel.config import ParallelConfig
from engine.parallel.group import Group
from engine.parallel.loader import load_parallel_model
from engine.parallel.runner import ParallelModelRunner, agree_num_blocks
from engine.parallel.sharding import ShardPlan


def build_parallel_runner(parallel: ParallelConfig, cache: CacheConfig, path: Path, model_cfg: ModelConfig,
                          dtype: torch.dtype, device: torch.device) -> ParallelModelRunner:
    plan = ShardPlan.of(model_cfg, parallel)  # a bad split fails here, before any rank waits on another
    group = Group.create(parallel, device)
    try:
        model = load_parallel_model(path, plan, dtype, device, group)
        if device.type == "cpu":
            pack_linears_for_cpu(model, dtype)
        blocks = agree_num_blocks(group, kv_cache_blocks(cache, plan.local_config(), dtype, device), device)
        runner = ParallelModelRunner(model, plan, blocks, cache.block_size, dtype, device, group)
        return runner.start_keepalive() if runner.is_leader else runner
    except BaseException:
        group.close()
        raise
