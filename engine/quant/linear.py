"""Weight-only quantized linears: the weights stay int8 / int4 in memory and the matmul
reads them as such (torch's CPU weight-only kernels), so a bandwidth-bound decode step
moves a quarter or an eighth of float32's bytes.

torch's kernels are vectorised for bfloat16 activations (float32 ones take a scalar path
~10x slower, measured on an AVX-512 EPYC), so activations are cast to bfloat16 around the
matmul and back; scales are bfloat16 as the kernels want them. Shapes: x (T, in) -> (T, out).

Those kernels are GEMV-shaped: from DENSE_ROWS rows on (prefill chunks), dequantizing the
weight to bfloat16 and running one dense matmul is faster, because the dequantization is paid
once for all rows (measured on a 2-core AVX-512 EPYC, SmolLM2's MLP shapes: 64 rows 1.5-2x,
512 rows 2.5x; at 16 rows the kernels still win). Decode steps keep reading the quantized bytes.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

COMPUTE = torch.bfloat16
DENSE_ROWS = 32


class QuantLinear(nn.Module):
    """Common part: optional float bias, the cast around the kernel."""

    dense_rows = DENSE_ROWS  # from this many rows on, one dense matmul of dense()

    def __init__(self, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.out_features = out_features
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xc = x.to(COMPUTE)
        y = F.linear(xc, self.dense()) if x.shape[0] >= self.dense_rows else self.matmul(xc)
        y = y.to(x.dtype)
        return y + self.bias if self.bias is not None else y

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dense(self) -> torch.Tensor:
        """W (out, in) in bfloat16, made from the quantized bytes for one matmul."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """W (out, in) in float32, as the kernels see it (what tests and tools compare)."""
        return self.dense().float()

    def weight_bytes(self) -> int:
        """Bytes one forward reads for its weights (what the decode floor counts)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())


class Int8Linear(QuantLinear):
    """Per-output-channel symmetric int8: W[n, :] ~= q[n, :] * scale[n]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(q.shape[0], bias)
        self.register_buffer("q", q.contiguous())  # (out, in) int8
        self.register_buffer("scale", scale.to(COMPUTE).contiguous())  # (out,)

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """w: (out, in) float. The scale is rounded to bfloat16 first, then q is rounded
        against that rounded scale, so the kernel's W equals q * scale exactly."""
        w = w.float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(COMPUTE)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return cls(q, scale, bias)

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale.float()[:, None]  # exactly the kernel's W

    def dense(self) -> torch.Tensor:
        return self.q.to(COMPUTE) * self.scale[:, None]  # q is exact in bfloat16: one rounding

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, self.q, self.scale)


class BlockInt8Linear(QuantLinear):
    """GGUF Q8_0 kept as is: blocks of 32 input features share one scale,
    W[n, 32b + j] = q[b, n, j] * d[b, n]. torch's int8 kernel takes one scale per output row,
    so the matmul runs block by block (in / 32 calls) and sums the partial products."""

    def __init__(self, q: torch.Tensor, d: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(q.shape[1], bias)
        self.register_buffer("q", q.contiguous())  # (in/32, out, 32) int8
        self.register_buffer("d", d.to(COMPUTE).contiguous())  # (in/32, out)

    def dequantize(self) -> torch.Tensor:
        w = self.q.float() * self.d.float()[..., None]  # (B, out, 32), exactly the kernel's W
        return w.permute(1, 0, 2).reshape(self.out_features, -1)

    def dense(self) -> torch.Tensor:
        w = self.q.to(COMPUTE) * self.d[..., None]  # (B, out, 32)
        return w.permute(1, 0, 2).reshape(self.out_features, -1)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.view(x.shape[0], self.q.shape[0], 32)
        y = torch._weight_int8pack_mm(xb[:, 0].contiguous(), self.q[0], self.d[0]).float()
        for b in range(1, self.q.shape[0]):
            y += torch._weight_int8pack_mm(xb[:, b].contiguous(), self.q[b], self.d[b])
        return y.to(x.dtype)


@functools.cache
def int4_pack_rows() -> int:
    """How many rows torch's int4 CPU packing interleaves in one run: 64 where its kernels are
    built for AVX-512, 32 for AVX2. Read off the packing itself: row 16 of a run of 64 is the
    low nibble of byte 16; in a run of 32 it is the high nibble of byte 0."""
    probe = torch.zeros(64, 2, dtype=torch.int32)
    probe[16, 0] = 1
    packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1).view(-1)
    return 32 if int(packed[0]) >> 4 else 64


class Int4Linear(QuantLinear):
    """Groupwise asymmetric int4 (GGUF Q4_0 / Q4_1 blocks of 32): W[n, k] = (q - 8) * scale + zero,
    scale and zero per (k // group, n), the layout of torch's int4 CPU kernel."""

    # Unpacking int4 costs ~3-10x int8's dequantization, and the int4 kernel's time grows with
    # the rows only as fast as a dense matmul's: they meet near 512 rows (2-core Xeon, Qwen2.5-0.5B
    # MLP shapes: at 64 rows kernel 8 ms vs unpack + matmul 42 ms; at 512, 76 vs 75).
    dense_rows = 512

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None = None):
        super().__init__(q.shape[0], bias)
        self.group = group
        # (out, in) int32 in [0, 16) -> torch's packed layout (out, in/2) uint8
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
        # (in/g, out, 2): the kernel's (scale, zero) pairs
        self.register_buffer("scale_zero", torch.stack((scale, zero), dim=-1).to(COMPUTE).contiguous())

    @classmethod
    def quantize(cls, w: torch.Tensor, bias: torch.Tensor | None = None, group: int = 32) -> Int4Linear:
        """w: (out, in) float, in % group == 0: round-to-nearest per group of `group` input
        features between the group's min and max (GGUF Q4_1's scheme). scale and zero are rounded
        to bfloat16 first and q against them, so the kernel's W equals (q - 8) * scale + zero."""
        n, k = w.shape
        wg = w.float().view(n, k // group, group)
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        scale = ((hi - lo) / 15).clamp(min=1e-12).to(COMPUTE)
        zero = (lo + 8 * scale.float()).to(COMPUTE)
        base = zero.float() - 8 * scale.float()  # W of q = 0
        q = torch.round((wg - base[..., None]) / scale.float()[..., None]).clamp(0, 15).view(n, k)
        return cls(q.to(torch.int32), scale.t(), zero.t(), group, bias)

    def dense(self) -> torch.Tensor:
        n, k = self.out_features, self.packed.shape[1] * 2
        run = int4_pack_rows()
        if n % run:  # a layout this file does not unpack: ask the kernel (an identity matmul)
            eye = torch.eye(k, dtype=COMPUTE)
            return torch._weight_int4pack_mm_for_cpu(eye, self.packed, self.group, self.scale_zero).t()
        # torch's CPU layout: rows in runs of `run`; byte (r, k, j) holds row run r + j in its low
        # nibble and row run r + run/2 + j in its high one (tests/unit/test_quant.py checks it).
        b = self.packed.view(n // run, k, run // 2)
        q = torch.cat((b & 0xF, b >> 4), dim=2).permute(0, 2, 1).reshape(n, k // self.group, self.group)
        sz = self.scale_zero.transpose(0, 1)  # (out, in/g, 2)
        return torch.addcmul(sz[..., 1:], q.to(COMPUTE) - 8, sz[..., :1]).reshape(n, k)  # (q - 8) s + z

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scale_zero)
