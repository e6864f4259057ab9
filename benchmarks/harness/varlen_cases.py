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
    num_draft: int = 0  # speculative proposals (engine/spec; never on parallel ranks: refused at config)


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


@dataclass
class Inputs:
    """One case's batch and tensors: a random pool holding every sequence's history, and the
    batch's new q/k/v."""

    runner: ModelRunner
    batch: list[_Scheduled]
    pool: torch.Tensor  # (2, NB, bs, Hkv, hd)
    q: torch.Tensor  # (T, H, hd)
    k: torch.Tensor  # (T, Hkv, hd)
    v: torch.Tensor


def make_inputs(case: str, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Inputs:
    batch = make_batch(case, seed)
    g = torch.Generator().manual_seed(seed)
    t = sum(s.num_new_tokens for s in batch)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    return Inputs(make_runner(device, dtype), batch, rand(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM),
                  rand(t, HEADS, HEAD_DIM), rand(t, KV_HEADS, HEAD_DIM), rand(t, KV_HEADS, HEAD_DIM))


def attend(inputs: Inputs, kernel) -> torch.Tensor:
    """Attention over the case through the varlen backend with `kernel`, or (None) the
    reference path. Each call gets its own copy of the pool to write the new K/V into."""
    inputs.runner.varlen_kernel = kernel
    _, _, meta, _ = inputs.runner._prepare(inputs.batch)
    assert (meta.varlen is not None) == (kernel is not None)
    kv = inputs.pool.clone()
    return paged_attention(inputs.q, inputs.k, inputs.v, kv[0], kv[1], meta, HEAD_DIM**-0.5)


def attend_both_ways(case: str, device: torch.device, dtype: torch.dtype, kernel,
                     seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(varlen backend's output, reference output) on identical inputs."""
    inputs = make_inputs(case, device, dtype, seed)
    return attend(inputs, kernel), attend(inputs, None)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())
