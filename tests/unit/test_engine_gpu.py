"""CUDA checks: the same engine code on a GPU gives the CPU's greedy tokens (skipped without CUDA)."""
from __future__ import annotations

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = [[5, 17, 300, 42], list(range(100, 190)), [7] * 33]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _engine(device: str, dtype: str = "float32") -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", device=device, dtype=dtype, cache=CacheConfig(num_blocks=256)))


def test_cuda_float32_matches_cpu():
    cpu = [o.token_ids for o in _engine("cpu").generate(PROMPTS, GREEDY)]
    gpu_engine = _engine("cuda")
    assert gpu_engine.runner.kv_cache.is_cuda
    assert [o.token_ids for o in gpu_engine.generate(PROMPTS, GREEDY)] == cpu


def test_cuda_bfloat16_generates_and_frees_blocks():
    engine = _engine("cuda", "bfloat16")
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0.7, seed=3, ignore_eos=True))
    assert all(len(o.token_ids) == 8 for o in outs)
    assert engine.pool.num_free == engine.pool.num_blocks
