"""Attention batches for checking the varlen backend against attention.py's reference path:
decodes of several context lengths, a chunk continuing a prompt, a fresh prompt and a
prefix-cache hit, all over shuffled, non-contiguous block tables of one random pool."""
from __future__ import annotations

import random
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from engine.model_runner import ModelRunner
from engine.models.attention import paged_attention

BLOCK = 4
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64
NUM_BLOCKS = 64


@dataclass
class _Seq:
    token_ids: list[int]
    num_computed: int
    block_table: list[int]


@dataclass
class _Scheduled:
    seq: _Seq
    num_new_tokens: int
    samples: bool = True


# (tokens with KV before this step, new tokens): decodes first, as the scheduler orders them.
CASES = {
    "decodes": [(4, 1), (8, 1), (13, 1), (30, 1)],
    "chunk_with_history": [(12, 7)],
    "prefix_hit": [(16, 3)],
    "mixed": [(5, 1), (21, 1), (9, 6), (0, 11), (16, 5)],
}


def make_batch(case: str, seed: int = 0) -> list[_Scheduled]:
    """Each sequence gets its blocks drawn at random from the pool (no two share one)."""
    rng = random.Random(seed)
    free = list(range(1, NUM_BLOCKS))  # block 0 stays the reference path's padding block
    rng.shuffle(free)
    batch = []
    for cached, new in CASES[case]:
        nb = -(-(cached + new) // BLOCK)
        table, free = free[:nb], free[nb:]
        batch.append(_Scheduled(_Seq(list(range(cached + new)), cached, table), new))
    return batch


def make_runner(device: torch.device, dtype: torch.dtype) -> ModelRunner:
    shape = SimpleNamespace(num_layers=1, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    return ModelRunner(None, shape, NUM_BLOCKS, BLOCK, dtype, device)


def attend_both_ways(case: str, device: torch.device, dtype: torch.dtype, kernel,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(varlen backend's output, reference output) on identical inputs: one random pool
    holding every sequence's history, and the batch's new q/k/v. Each path gets its own copy
    of the pool, so the new K/V each writes are its own."""
    batch = make_batch(case, seed)
    runner = make_runner(device, dtype)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    t = sum(s.num_new_tokens for s in batch)
    q = torch.randn(t, HEADS, HEAD_DIM, generator=g).to(device, dtype)
    k = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    v = torch.randn(t, KV_HEADS, HEAD_DIM, generator=g).to(device, dtype)
    scale = HEAD_DIM**-0.5
    outs = []
    for use in (kernel, None):
        runner.varlen_kernel = use
        _, _, meta, _ = runner._prepare(batch)
        assert (meta.varlen is not None) == (use is not None)
        kv = pool.clone()
        outs.append(paged_attention(q, k, v, kv[0], kv[1], meta, scale))
    return outs[0], outs[1]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())
