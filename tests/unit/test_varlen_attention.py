"""The varlen attention backend (engine/models/varlen_attention.py) against attention.py's
reference path. On CPU the packed metadata and the K/V gather are checked through the SDPA
stand-in kernel; the FlashAttention kernel itself is checked on CUDA (marked gpu)."""
from __future__ import annotations

import pytest
import torch
from helpers import greedy, make_engine, make_prompts

from benchmarks.harness.varlen_cases import CASES, attend_both_ways, relative_error
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.models.varlen_attention import default_kernel, flash_varlen, sdpa_varlen, varlen_metadata

CPU = torch.device("cpu")


def test_metadata_packs_sequences_in_batch_order():
    # A decode over 6 tokens in blocks [7, 3], a new prompt of 1, a chunk of 4 ending at 9 tokens.
    meta = varlen_metadata([(1, 6, [7, 3]), (1, 1, [5]), (4, 9, [2, 8, 0, 11])], 4, CPU, sdpa_varlen)
    assert meta.cu_seq_q.tolist() == [0, 1, 2, 6] and meta.cu_seq_q.dtype == torch.int32
    assert meta.cu_seq_k.tolist() == [0, 6, 7, 16] and meta.cu_seq_k.dtype == torch.int32
    assert (meta.max_q, meta.max_k) == (4, 9)
    # Keys in position order, block by block; blocks past the context are not read.
    assert meta.kv_slots.tolist() == [28, 29, 30, 31, 12, 13, 20, 8, 9, 10, 11, 32, 33, 34, 35, 0]


@pytest.mark.parametrize("case", CASES)
def test_packed_metadata_matches_the_reference_on_cpu(case):
    got, want = attend_both_ways(case, CPU, torch.float32, sdpa_varlen)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_packed_path_keeps_greedy_tokens_of_the_engine_on_cpu():
    """Chunked prefill, prefix hits and decodes through the packed path: the same tokens."""
    prompts = make_prompts([40, 40, 23, 9], seed=3)
    prompts[1][:32] = prompts[0][:32]  # a prefix hit of 8 blocks
    outputs = []
    for kernel in (None, sdpa_varlen):
        engine = make_engine("tiny", budget=24)  # 24-token steps: prompts run in chunks
        engine.runner.varlen_kernel = kernel
        outputs.append([o.token_ids for o in engine.generate(prompts, greedy(12))])
    assert outputs[0] == outputs[1]


def test_the_hook_picks_flash_only_for_cuda_half_precision():
    assert default_kernel(CPU, torch.bfloat16, 64) is None
    assert default_kernel(torch.device("cuda"), torch.float32, 64) is None
    assert default_kernel(torch.device("cuda"), torch.bfloat16, 7) is None
    assert default_kernel(torch.device("cuda"), torch.bfloat16, 128) in (flash_varlen, None)  # None: no varlen_attn
    assert make_engine("tiny").runner.varlen_kernel is None  # CPU float32: the reference


# -- CUDA ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_flash_varlen_matches_the_reference(case, dtype):
    cuda = torch.device("cuda")
    assert default_kernel(cuda, dtype, 64) is flash_varlen
    got, want = attend_both_ways(case, cuda, dtype, flash_varlen)
    assert relative_error(got, want) <= 1e-2


@pytest.mark.gpu
def test_flash_varlen_keeps_greedy_tokens_on_the_bench_preset():
    prompts = make_prompts([200, 64, 130, 17, 300, 90, 48, 256], seed=5, vocab=32000)
    prompts[2][:128] = prompts[0][:128]  # a prefix hit
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    outputs = []
    for use_flash in (True, False):
        engine = LLMEngine(EngineConfig(model="bench", device="cuda", dtype="bfloat16",
                                        cache=CacheConfig(num_blocks=1024)))
        assert engine.runner.varlen_kernel is flash_varlen
        if not use_flash:
            engine.runner.varlen_kernel = None
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
    same = sum(a == b for fast, ref in zip(*outputs) for a, b in zip(fast, ref))
    assert same / sum(len(ref) for ref in outputs[1]) >= 0.95
