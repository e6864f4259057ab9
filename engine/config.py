"""Typed configuration for the engine: one small frozen model per concern.

Each component receives only its own sub-config. `EngineConfig` composes them and is
built once (from CLI flags or a file) at the edge.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.parallel.config import ParallelConfig


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Frozen = _Frozen  # the one frozen, extra-forbidding base of every config (router/ and cluster/ too)


class Role(str, Enum):
    """What an engine does with a request.

    mixed: prefill and decode in one engine. prefill: finish each request after its
    first token and keep its KV blocks for export. decode: accept requests together
    with their KV blocks and first token.
    """

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class HiCacheConfig(_Frozen):
    """Host-memory (L2) and disk (L3) tiers under the device pool (L1); off unless enabled."""

    enabled: bool = False
    # L2 budget: bytes of KV blocks kept in host memory (pinned on CUDA).
    host_bytes: int = Field(1 << 30, ge=0)
    # L3: a directory on local disk (created 0700); None leaves L3 off.
    disk_dir: str | None = None
    disk_bytes: int = Field(8 << 30, ge=0)
    # write_through: copy each block to L2 when it is cached in L1 (L1 evictions then cost nothing).
    # write_back: copy to L2 only when L1 evicts it. L2 -> L3 is always written back on L2 eviction.
    write_policy: Literal["write_through", "write_back"] = "write_through"
    # Selective: a block goes down a tier only once it was hit this often (0: every block).
    hit_threshold: int = Field(0, ge=0)
    # wait: a queued request's L3 reads always complete before its prefill; best_effort: blocks
    # not read within prefetch_timeout_s of scheduling are recomputed.
    prefetch_policy: Literal["wait", "best_effort"] = "wait"
    prefetch_timeout_s: float = Field(0.05, ge=0.0)


class CacheConfig(_Frozen):
    block_size: int = Field(16, ge=1, le=1024)
    # Number of KV blocks in the device pool. None: size from `memory_fraction`
    # of free device memory on CUDA, or from `cpu_kv_bytes` on CPU.
    num_blocks: int | None = Field(None, ge=2)
    cpu_kv_bytes: int = Field(256 << 20, ge=1 << 16)
    memory_fraction: float = Field(0.85, gt=0.0, le=1.0)
    enable_prefix_cache: bool = True
    # Keep a log of cache events (engine.cache_events) for a prefix-index publisher to take.
    record_events: bool = False
    hicache: HiCacheConfig = HiCacheConfig()


class SchedulerConfig(_Frozen):
    max_num_seqs: int = Field(128, ge=1)
    # Tokens processed per step (prefill chunks + one per running decode).
    max_num_batched_tokens: int = Field(2048, ge=16)
    # Split long prompts into chunks that fit the step budget.
    enable_chunked_prefill: bool = True


class EngineConfig(_Frozen):
    model: str = "tiny"
    # Salts block hashes so two models never share prefix-cache entries; defaults to the
    # preset name or the checkpoint directory's name.
    model_id: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    role: Role = Role.MIXED
    seed: int = 0
    # Caps prompt + output length below the model's own limit when set.
    max_model_len: int | None = Field(None, ge=1)
    num_threads: int | None = Field(None, ge=1)
    # Weight-only quantization (engine.quant): "int8" per channel at load; "gguf" keeps a GGUF
    # checkpoint's Q4/Q8_0 blocks quantized. Activations then run in bfloat16 around the matmuls.
    quantization: Literal["none", "int8", "gguf"] = "none"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Tensor/expert parallel split of the model over ranks (engine.parallel); size 1 by default.
    parallel: ParallelConfig = ParallelConfig()

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.cache.block_size > self.scheduler.max_num_batched_tokens:
            raise ValueError("cache.block_size must not exceed scheduler.max_num_batched_tokens")
        if self.cache.hicache.enabled and not self.cache.enable_prefix_cache:
            raise ValueError("cache.hicache.enabled needs cache.enable_prefix_cache")
        if self.quantization != "none" and self.parallel.world_size > 1:
            raise ValueError("quantization is not supported with tensor/expert parallel yet: use parallel size 1")
        return self
