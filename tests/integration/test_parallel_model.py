"""Tensor- and expert-parallel engines (engine.parallel) over real gloo groups, one process per
rank, against the single-process engine on the same random-weight checkpoints.

Greedy tokens must be equal and the top-5 logprobs close (float32; only the summation order
of the all-reduces differs).
"""
from __future__ import annotations

import pytest
import torch
from helpers import make_engine, make_prompts
from parallel_group import run_group

from engine import SamplingParams
from engine.model_config import ModelConfig
from engine.parallel import ParallelConfig
from engine.parallel.sharding import ShardPlan, kv_head_range

PROMPTS = make_prompts([5, 11, 3], seed=7)
MAX_TOKENS = 6


def reference(model, prompts=PROMPTS) -> list[dict]:
    torch.set_num_threads(1)
    engine = make_engine(model, num_blocks=128)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    return [{"token_ids": o.token_ids, "logprobs": [[[t, lp] for t, lp in s.top] for s in o.logprobs]}
            for o in engine.generate(prompts, params)]


def assert_same(got: list[dict], want: list[dict]) -> None:
    assert [g["token_ids"] for g in got] == [w["token_ids"] for w in want]
    for g, w in zip(got, want):
        for gs, ws in zip(g["logprobs"], w["logprobs"]):
            assert [t for t, _ in gs] == [t for t, _ in ws]
            assert torch.allclose(torch.tensor([v for _, v in gs]), torch.tensor([v for _, v in ws]), atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3", "llama-gqa"])
def test_tp2_matches_tp1(name, hf_checkpoints, tmp_path):
    model = hf_checkpoints.get(name)
    assert_same(run_group(model, tmp_path, PROMPTS, tp=2, max_tokens=MAX_TOKENS), reference(model))


def test_tp4_replicates_kv_heads(hf_checkpoints, tmp_path):
    """4 ranks, 2 KV heads: each KV head lives on two ranks (the GQA replication rule)."""
    model = hf_checkpoints.get("llama3-rope")
    assert_same(run_group(model, tmp_path, PROMPTS[:1], tp=4, max_tokens=MAX_TOKENS), reference(model, PROMPTS[:1]))


def test_qwen3_moe_ep2_matches_ep1(hf_checkpoints, tmp_path):
    model = hf_checkpoints.get("qwen3-moe")
    assert_same(run_group(model, tmp_path, PROMPTS, ep=2, max_tokens=MAX_TOKENS), reference(model))


def test_qwen3_moe_tp2_splits_every_expert(hf_checkpoints, tmp_path):
    model = hf_checkpoints.get("qwen3-moe")
    assert_same(run_group(model, tmp_path, PROMPTS[:2], tp=2, max_tokens=MAX_TOKENS), reference(model, PROMPTS[:2]))


def test_a_failed_rank_by_rank_kv_write_fails_the_request_not_the_group(hf_checkpoints, tmp_path):
    """Rank 1's receive fails: rank 0's write_local raises LocalKVFailed, the group stays
    healthy, and the same engine then generates the reference tokens."""
    model = hf_checkpoints.get("qwen3")
    got = run_group(model, tmp_path, PROMPTS[:1], tp=2, max_tokens=MAX_TOKENS, fail_local_kv=True)
    assert_same(got, reference(model, PROMPTS[:1]))


@pytest.mark.gpu
def test_tp2_nccl_matches_tp1(hf_checkpoints, tmp_path):
    """The same over NCCL with CUDA tensors, one GPU per rank."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model = hf_checkpoints.get("qwen3")
    assert_same(run_group(model, tmp_path, PROMPTS, tp=2, max_tokens=MAX_TOKENS, device="cuda"), reference(model))


# -- the split itself (no processes) ---------------------------------------------------------
def _cfg(**kw) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                num_heads=8, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                max_position_embeddings=64, tie_word_embeddings=False)
    return ModelConfig(**{**base, **kw})


def test_kv_heads_split_or_replicate():
    assert [kv_head_range(8, 4, 2, r) for r in range(2)] == [(0, 2), (2, 2)]
    assert [kv_head_range(8, 2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(8, 1, 4, r) for r in range(4)] == [(0, 1)] * 4


def test_vocab_rows_padded_on_the_last_rank():
    plans = [ShardPlan(_cfg(), tp_size=4, rank=r) for r in range(4)]
    assert [p.vocab for p in plans] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    assert plans[0].local_config().num_kv_heads == 1 and plans[0].local_config().num_heads == 2


@pytest.mark.parametrize(("kw", "tp", "ep", "field"), [
    (dict(num_heads=6, num_kv_heads=6), 4, 1, "attention heads"),
    (dict(num_heads=12, num_kv_heads=3), 4, 1, "KV heads"),
    (dict(intermediate_size=10), 4, 1, "intermediate_size"),
    (dict(), 1, 2, "needs an MoE model"),
    (dict(architecture="qwen3_moe", num_experts=3, num_experts_per_tok=1, moe_intermediate_size=4), 1, 2, "experts"),
])
def test_bad_splits_name_the_field(kw, tp, ep, field):
    with pytest.raises(ValueError, match=field):
        ShardPlan.of(_cfg(**kw), ParallelConfig(tp_size=tp, ep_size=ep))


def test_parallel_config_rejects_mismatched_sizes():
    with pytest.raises(ValueError, match="tp_size"):
        ParallelConfig(tp_size=2, ep_size=4)
    with pytest.raises(ValueError, match="rank 2"):
        ParallelConfig(tp_size=2, rank=2)
    with pytest.raises(ValueError, match="rendezvous"):
        ParallelConfig(tp_size=2, rendezvous="redis://x")
