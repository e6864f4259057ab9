"""MoE experts in grouped GEMMs (engine/models/grouped_moe.py) against SparseMoE's expert loop.

torch 2.13 runs grouped_mm on CPU in float32, so the sorting, offsets, expert-parallel
masking and combine are checked here; bfloat16 on CUDA is marked gpu."""
from __future__ import annotations

import pytest
import torch

from engine.models.grouped_moe import _grouped_mm, grouped_experts, use_grouped_mm
from engine.models.layers import SparseMoE

HIDDEN, INTER, EXPERTS, TOP_K = 32, 16, 6, 2


def make_moe(seed: int = 0, device: str = "cpu", dtype: torch.dtype = torch.float32) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, TOP_K, norm_topk_prob=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe.to(device, dtype)


def loop_reference(moe: SparseMoE, x: torch.Tensor, first: int, count: int) -> torch.Tensor:
    """The expert loop over experts first .. first + count - 1 only (what an EP rank holds)."""
    weights, experts = moe.route(x)
    out = torch.zeros_like(x)
    for e in range(first, first + count):
        tok, slot = (experts == e).nonzero(as_tuple=True)
        gate, up = (x[tok] @ moe.w13[e]).chunk(2, dim=-1)
        out.index_add_(0, tok, (torch.nn.functional.silu(gate) * up) @ moe.w2[e] * weights[tok, slot, None])
    return out


cpu_grouped = pytest.mark.skipif(_grouped_mm is None, reason="this torch has no grouped_mm")


@cpu_grouped
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_grouped_experts_match_the_loop(tokens):
    moe = make_moe()
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.inference_mode():
        weights, experts = moe.route(x)
        got = grouped_experts(x, weights, experts, moe.w13, moe.w2)
        torch.testing.assert_close(got, moe(x), rtol=1e-5, atol=1e-5)  # CPU float32: the loop


@cpu_grouped
def test_grouped_experts_take_only_this_ranks_experts():
    moe = make_moe(1)
    x = torch.randn(25, HIDDEN, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        weights, experts = moe.route(x)
        parts = []
        for first in (0, 3):  # two EP ranks of three experts each
            local = grouped_experts(x, weights, experts, moe.w13[first : first + 3], moe.w2[first : first + 3], first)
            torch.testing.assert_close(local, loop_reference(moe, x, first, 3), rtol=1e-5, atol=1e-5)
            parts.append(local)
        torch.testing.assert_close(parts[0] + parts[1], moe(x), rtol=1e-5, atol=1e-5)


def test_the_hook_keeps_the_loop_for_cpu_and_float32():
    assert not use_grouped_mm(torch.zeros(2, 2))
    assert not use_grouped_mm(torch.zeros(2, 2, dtype=torch.bfloat16))


@pytest.mark.gpu
def test_grouped_experts_match_the_loop_in_bfloat16_on_cuda():
    moe = make_moe(3, "cuda", torch.bfloat16)
    x = torch.randn(64, HIDDEN, device="cuda", dtype=torch.bfloat16)
    assert use_grouped_mm(x)
    with torch.inference_mode():
        got = moe(x)  # the grouped path
        want = loop_reference(moe, x, 0, EXPERTS)
    assert float((got.float() - want.float()).norm() / want.float().norm()) <= 1e-2
