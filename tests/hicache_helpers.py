"""Builders for the HiCache tests: tiny-preset engines with host/disk tiers, prompts, a reference run."""
from __future__ import annotations

import random
from pathlib import Path

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.config import HiCacheConfig

BLOCK = 4
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # tiny preset: (2, L=2, bs, Hkv=2, hd=32) float32
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def tiered_engine(disk_dir: Path | None, *, num_blocks: int = 24, host_blocks: int = 64, disk_blocks: int = 10_000,
                  record_events: bool = False, budget: int = 256, device: str = "cpu", **hicache) -> LLMEngine:
    hc = HiCacheConfig(enabled=True, host_bytes=host_blocks * BLOCK_BYTES,
                       disk_dir=str(disk_dir) if disk_dir else None, disk_bytes=disk_blocks * (BLOCK_BYTES + 400),
                       **hicache)
    return LLMEngine(EngineConfig(
        model="tiny", device=device, dtype="float32",
        cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks, record_events=record_events, hicache=hc),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget)))


def plain_engine(num_blocks: int = 64, prefix_cache: bool = False) -> LLMEngine:
    """The recompute reference: no prefix cache at all."""
    return LLMEngine(EngineConfig(model="tiny", device="cpu", dtype="float32",
                                  cache=CacheConfig(block_size=BLOCK, num_blocks=num_blocks,
                                                    enable_prefix_cache=prefix_cache)))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]
