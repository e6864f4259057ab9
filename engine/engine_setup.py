"""Builds an engine's collaborators from its config: model, KV pool, cache, scheduler, sampler."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.block_pool import BlockPool
from engine.cache_events import CacheEventLog
from engine.config import EngineConfig
from engine.fingerprint import checkpoint_fingerprint, fingerprinted
from engine.hicache import TierManager
from engine.loader import load_model
from engine.model_config import DTYPES, ModelConfig
from engine.model_runner import ModelRunner, kv_cache_blocks
from engine.models.layers import pack_linears_for_cpu
from engine.parallel.setup import build_parallel_runner
from engine.presets import PRESETS, resolve_model
from engine.quant import quantize_model
from engine.radix_cache import RadixCache
from engine.sampler import Sampler
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer


@dataclass
class EngineParts:
    model_id: str
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    runner: ModelRunner
    pool: BlockPool
    cache: RadixCache | None
    scheduler: Scheduler
    sampler: Sampler
    hicache: TierManager | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available; use --device cpu")
    return device


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device,
                  cpuinfo: str = "/proc/cpuinfo") -> torch.dtype:
    """`name`'s dtype; "auto": the checkpoint's on CUDA, on CPU bfloat16 where the CPU multiplies
    bfloat16 in hardware (flags read from `cpuinfo`), else float32."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return DTYPES[model_cfg.torch_dtype]
    # Measured quietly on an AMD EPYC with avx512_bf16 (2 threads, SmolLM2-135M, packed oneDNN
    # linears), bfloat16 beat float32 on every workload: bs1 decode 32-38 vs 50 ms per token,
    # 512-token TTFT 0.46-0.51 vs 0.75 s, 16-prompt batch 187 vs 108 tok/s. Without the
    # instructions bfloat16 is emulated and ~500x slower.
    # benchmarks/peer_bench.py records auto's pick against the other dtype on each machine it
    # runs on (ratios auto_*_vs_other_dtype).
    return torch.bfloat16 if cpu_has_bf16_dot(cpuinfo) else torch.float32


# CPU instructions that multiply bfloat16 pairs in hardware: avx512_bf16 (AMD Zen4, Intel
# Cooper Lake and later) and AMX (Intel Sapphire Rapids and later). Without them (e.g. AMD
# Zen3) a bfloat16 matmul is emulated and was measured ~500x slower than float32.
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_bf16_dot(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in BF16_CPU_FLAGS)
    except OSError:
        pass
    return False


def model_id_for(cfg: EngineConfig, path: Path) -> str:
    """The name block hashes are salted with: configured, a preset's or registry model's name, or the
    directory's name."""
    from engine.registry import REGISTRY

    return cfg.model_id or (cfg.model if cfg.model in PRESETS or cfg.model in REGISTRY else path.name)


def engine_model_id(cfg: EngineConfig, path: Path | None = None) -> str:
    """What an engine of `cfg` hashes blocks and names its KV with: the name, then the
    checkpoint's fingerprint (swapped weights under the same name get a new id)."""
    path = path or resolve_model(cfg.model)
    return fingerprinted(model_id_for(cfg, path), checkpoint_fingerprint(path))


def context_length(max_model_len: int | None, model_cfg: ModelConfig) -> int:
    """Tokens a sequence may hold: the configured limit, capped by the model's positions."""
    return min(max_model_len or model_cfg.max_position_embeddings, model_cfg.max_position_embeddings)


def build_parts(cfg: EngineConfig) -> EngineParts:
    path = resolve_model(cfg.model)
    model_cfg = ModelConfig.from_dir(path)
    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, model_cfg, device)
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    max_len = context_length(cfg.max_model_len, model_cfg)
    if cfg.parallel.world_size > 1:
        runner = build_parallel_runner(cfg.parallel, cfg.cache, path, model_cfg, dtype, device)
    else:
        model = load_model(path, model_cfg, dtype, device)
        quantize_model(model, cfg.quantization, path)
        if device.type == "cpu":
            pack_linears_for_cpu(model, dtype)
        num_blocks = kv_cache_blocks(cfg.cache, model_cfg, dtype, device)
        runner = ModelRunner(model, model_cfg, num_blocks, cfg.cache.block_size, dtype, device)
    num_blocks = runner.kv_cache.shape[2]
    pool = BlockPool(num_blocks)
    cache = RadixCache(pool, CacheEventLog(cfg.cache.record_events)) if cfg.cache.enable_prefix_cache else None
    model_id = engine_model_id(cfg, path)
    scheduler = Scheduler(cfg.scheduler, pool, cache, cfg.cache.block_size, model_id)
    hicache = None
    if cache is not None and cfg.cache.hicache.enabled:
        hicache = TierManager(cfg.cache.hicache, runner, pool, cache, model_id, cfg.cache.block_size)
        scheduler.loader = hicache
    return EngineParts(model_id, model_cfg, Tokenizer.from_dir(path), device, dtype, max_len,
                       runner, pool, cache, scheduler, Sampler(device, cfg.seed), hicache)
