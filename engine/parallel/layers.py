"""Parallel versions of the model's modules, swapped in by engine.parallel.loader.

Each keeps its single-device twin's parameter names, so the loader fills them alike; only
the shapes are the rank's (see sharding.py) and the forward adds the one collective that
makes the rank's partial result whole:

- column-parallel (qkv_proj, gate_up_proj): the plain Linear on a slice of the output
  features; no communication, the next op works on the rank's heads / columns.
- RowParallelLinear (o_proj, down_proj): input features sliced, so each rank has a partial
  sum of the output; one all-reduce. Its bias lives on rank 0 only (zero elsewhere).
- VocabParallelEmbedding: rows for the rank's vocabulary slice; other ids give zeros; one
  all-reduce. ParallelLMHead: logits for the slice; one all-gather along the vocabulary.
- ParallelMoE: the router is replicated (every rank sees the same top-k); each rank runs its
  own experts (EP) or its slice of every expert (TP) on the tokens routed to them and the
  partial outputs are summed by one all-reduce of (T, hidden). This all-reduce dispatch is
  the same single collective the TP layers use: for decode-sized batches the message is a
  few KB per layer, latency-bound, and an all-to-all would need a count exchange plus two
  variable-sized exchanges (dispatch and combine) per layer for no bandwidth saving at
  this size. Large prefill batches on many ranks are where all-to-all would win.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.grouped_moe import grouped_experts, use_grouped_mm
from engine.models.layers import Linear, SparseMoE
from engine.parallel.group import Group


class RowParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, group: Group):
        super().__init__(in_features, out_features, bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, rows: int, hidden: int, first_row: int, group: Group):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.first_row, self.group = first_row, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first_row
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(x.masked_fill_(outside[:, None], 0))


class ParallelLMHead(Linear):
    def __init__(self, hidden: int, rows: int, vocab_size: int, group: Group):
        super().__init__(hidden, rows)
        self.vocab_size, self.group = vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = self.group.all_gather(super().forward(x))  # tp x (N, rows)
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]


class ParallelMoE(SparseMoE):
    """w13 (E_local, H, 2 I_local), w2 (E_local, I_local, H); the gate covers all experts."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, first_expert: int, local_experts: int,
                 top_k: int, norm_topk_prob: bool, group: Group):
        super().__init__(hidden, intermediate, local_experts, top_k, norm_topk_prob)
        self.gate = Linear(hidden, num_experts)
        self.first_expert, self.group = first_expert, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)  # (T, k), global expert ids
        if use_grouped_mm(x):
            return self.group.all_reduce(grouped_experts(x, weights, experts, self.w13, self.w2, self.first_expert))
        out = torch.zeros_like(x)
        for e in range(self.w13.shape[0]):
            tok, slot = (experts == self.first_expert + e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            gate, up = (x[tok] @ self.w13[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w2[e]  # (n, H)
            out.index_add_(0, tok, y * weights[tok, slot, None])
        return self.group.all_reduce(out)
