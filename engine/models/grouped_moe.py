"""MoE experts on CUDA in two grouped GEMMs (torch's grouped_mm), with no host sync.

layers.SparseMoE loops over experts in Python and reads the per-expert counts on the host
(a device sync per layer). Here the token-expert assignments are sorted by expert on the
device, and each GEMM runs every expert's rows at once, delimited by `offs`. Float32 and CPU
keep the loop, the exactness reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Public as F.grouped_mm from torch 2.10; torch._grouped_mm before (same arguments used here).
_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def use_grouped_mm(x: torch.Tensor) -> bool:
    """The hook: grouped GEMMs for CUDA bfloat16 activations (what the kernels support)."""
    return _grouped_mm is not None and x.is_cuda and x.dtype == torch.bfloat16


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """Sum over each token's routed experts held here of weight * expert(x).

    x: (T, H); weights, experts: (T, k), global expert ids; w13: (E, H, 2I), w2: (E, I, H) for
    experts first_expert .. first_expert + E - 1 (all of them without expert parallelism).
    Returns (T, H); tokens routed to no local expert get zeros."""
    num_local, top_k = w13.shape[0], experts.shape[1]
    local = experts.flatten() - first_expert  # (T*k,)
    held = (local >= 0) & (local < num_local)
    key = torch.where(held, local, num_local)  # other ranks' assignments sort last, outside every group
    order = key.argsort(stable=True)  # (T*k,)
    ends = torch.bincount(key, minlength=num_local + 1)[:num_local].cumsum(0).to(torch.int32)  # (E,)
    token = order // top_k
    h = _grouped_mm(x[token].contiguous(), w13, offs=ends)  # (T*k, 2I); rows past ends[-1] undefined
    gate, up = h.chunk(2, dim=-1)
    y = _grouped_mm((F.silu(gate) * up).contiguous(), w2, offs=ends)  # (T*k, H)
    scale = torch.where(held[order], weights.flatten()[order], 0).to(y.dtype)  # (T*k,)
    y = torch.where(held[order, None], y * scale[:, None], 0)  # undefined rows may hold NaN: select
    return torch.zeros_like(x).index_add_(0, token, y)
