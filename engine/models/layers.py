"""Building blocks shared by the decoder models, written for one device.

Op order follows transformers' Llama/Qwen3 code so float32 results agree to rounding.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.models.grouped_moe import grouped_experts, use_grouped_mm


class Linear(nn.Module):
    """y = x @ W^T + b. On CPU the engine packs W for oneDNN after loading (pack_for_cpu);
    until then, and on CUDA, W is a parameter in whichever layout streamed faster for a
    batch-1 GEMV through MKL: a GEMV that widens (out >= in) read W^T stored (in, out) about
    twice as fast as nn.Linear's (out, in) (measured ~20 vs ~9 GB/s), one that narrows was
    slightly faster in (out, in). The parameter is named `weight_t` in the first case and
    `weight` in the second; the loader fills both.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.transposed = out_features >= in_features
        shape = (in_features, out_features) if self.transposed else (out_features, in_features)
        w = nn.Parameter(torch.empty(shape))
        if self.transposed:
            self.weight_t = w
        else:
            self.weight = w
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.register_buffer("packed", None, persistent=False)  # oneDNN's layout of W, once packed

    def pack_for_cpu(self) -> None:
        """Hand W to oneDNN once, in its own blocked layout, and run every forward through it
        (what inductor's CPU weight freezing does). Measured against MKL on a 2-core AVX-512
        EPYC, 30 layers of SmolLM2's linears streamed from memory: float32 decode GEMVs about as
        fast, 16-row batches 2.4x, 512-token prefill 1.5x; bfloat16 1.3x, 1.8x and 1.3x.
        float32 results differ from MKL's by accumulation order only."""
        w = (self.weight_t.data.t() if self.transposed else self.weight.data).contiguous()  # (out, in)
        delattr(self, "weight_t" if self.transposed else "weight")
        self.transposed = False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        y = x @ self.weight_t
        return y + self.bias if self.bias is not None else y


def pack_linears_for_cpu(model: nn.Module, dtype: torch.dtype) -> int:
    """Pack every Linear (tensor-parallel ones included: they call Linear.forward) of a CPU
    float32 / bfloat16 model for oneDNN; returns how many. Quantized linears are another class
    and keep their own kernels. A no-op where torch was built without oneDNN, and for bfloat16
    where oneDNN has no bfloat16 path on this CPU (AVX2 without avx_ne_convert: MKL runs it)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return 0
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return 0
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.packed is None]
    for m in linears:
        m.pack_for_cpu()
    return len(linears)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call. float32: the same result as the reference's steps. bfloat16/float16: torch
        # normalises in float32 and rounds once after the weight, where the reference rounds
        # before it too (one rounding fewer; 5 fewer small ops per norm on a decode step).
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dim, without the weight: normalised in float32 whatever the
    activation dtype, then cast back, as the reference does (the weight multiplies after)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, x.shape[-1:], None, eps)
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv_freq / factor
    # Llama 3: leave high frequencies alone, divide low ones by `factor`, interpolate between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position (no per-step trig)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, hd)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for a batch's positions (T,), looked up once per forward: (T, 1, hd)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, hd) — queries and keys together; cos/sin: (T, 1, hd)
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class GatedMLP(nn.Module):
    """SwiGLU with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoE(nn.Module):
    """Top-k routed experts (Qwen3-MoE). Experts are stacked (in, out): w13 (E, H, 2I), w2 (E, I, H)."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.gate = Linear(hidden, num_experts)
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden, 2 * intermediate))
        self.w2 = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float)  # (T, E)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # (T, k)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if use_grouped_mm(x):  # CUDA bfloat16: two grouped GEMMs, no host sync (grouped_moe.py)
            return grouped_experts(x, weights, experts, self.w13, self.w2)
        out = torch.zeros_like(x)
        flat = experts.flatten()  # (T*k,)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        token_of = order // self.top_k  # token index of each sorted assignment
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            tok = token_of[start : start + n]
            start += n
            gate, up = (x[tok] @ self.w13[e]).chunk(2, dim=-1)
            y = (F.silu(gate) * up) @ self.w2[e]  # (n, H)
            out.index_add_(0, tok, y * weights.flatten()[idx, None])
        return out
