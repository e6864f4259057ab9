"""CUDA attention for bfloat16/float16: the whole batch in one packed variable-length
FlashAttention call per layer (torch.nn.attention.varlen_attn), instead of one SDPA call per
decode group and per prefill chunk under boolean masks (which in bfloat16 can fall back to
SDPA's math kernel and materialise heads x tokens x context scores).

Every sequence of the batch is one varlen segment: its new queries, and its keys and values
gathered from the paged cache in position order (history and the new tokens alike, as they
were just written). Causal masking is bottom-right aligned, as FlashAttention's is for
q_len < k_len: query i of a chunk of q_len sees the first k_len - q_len + i + 1 keys, which is
what a decode, a chunk continuing a prompt and a prefix-cache hit all need.

Float32 and CPU keep attention.py's code, the exactness reference. `sdpa_varlen` runs the
same packed metadata through SDPA, one sequence at a time: CPU tests and the device check's
smoke mode use it to check the metadata and the gather against the reference.
"""
from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "VarlenMetadata", float], torch.Tensor]


@dataclass
class VarlenMetadata:
    """The packed batch as one varlen call sees it; built once per step, read by every layer."""

    q_lens: list[int]  # new tokens of each sequence, in batch order
    k_lens: list[int]  # tokens with KV of each sequence after this step
    cu_seq_q: torch.Tensor  # (N+1,) int32: where each sequence's queries start in the batch
    cu_seq_k: torch.Tensor  # (N+1,) int32: where its keys start in the gathered K/V
    kv_slots: torch.Tensor  # (sum k_lens,) int64: flat cache slot of each gathered key
    kernel: Kernel  # flash_varlen on CUDA; sdpa_varlen to check the rest on CPU

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_k(self) -> int:
        return max(self.k_lens)


def varlen_metadata(spans: Sequence[tuple[int, int, Sequence[int]]], block_size: int, device: torch.device,
                    kernel: Kernel) -> VarlenMetadata:
    """spans: (new tokens, context length after this step, block table) per sequence, in the
    order their tokens are packed. Built on the host, copied to the device once."""
    q_lens = [q for q, _, _ in spans]
    k_lens = [k for _, k, _ in spans]
    nbs = [-(-k // block_size) for k in k_lens]
    blocks = torch.tensor([b for (_, _, table), nb in zip(spans, nbs) for b in table[:nb]], dtype=torch.long)
    slots = (blocks[:, None] * block_size + torch.arange(block_size)).reshape(-1)  # (sum nb*bs,)
    # Keep each sequence's first k_len slots: its last block may be partly filled.
    padded = torch.tensor(nbs) * block_size  # (N,)
    pos = torch.arange(slots.numel()) - (padded.cumsum(0) - padded).repeat_interleave(padded)
    kv_slots = slots[pos < torch.tensor(k_lens).repeat_interleave(padded)]  # (sum k_lens,)
    cu = torch.zeros(2, len(spans) + 1, dtype=torch.int32)  # rows: queries, keys
    cu[0, 1:] = torch.tensor(q_lens).cumsum(0)
    cu[1, 1:] = torch.tensor(k_lens).cumsum(0)
    cu = cu.to(device, non_blocking=True)
    kv_slots = kv_slots.to(device, non_blocking=True)
    return VarlenMetadata(q_lens, k_lens, cu[0], cu[1], kv_slots, kernel)


def varlen_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: VarlenMetadata,
                     scale: float) -> torch.Tensor:
    """q: (T, H, hd) the batch's queries; caches (NB, bs, Hkv, hd) already hold this step's
    K/V. Returns (T, H, hd)."""
    keys = k_cache.view(-1, *k_cache.shape[2:]).index_select(0, meta.kv_slots)  # (sum k, Hkv, hd)
    vals = v_cache.view(-1, *v_cache.shape[2:]).index_select(0, meta.kv_slots)
    return meta.kernel(q.contiguous(), keys, vals, meta, scale)


@functools.cache
def _varlen() -> tuple[Callable | None, frozenset[str]]:
    """torch's varlen_attn and the names of its parameters, imported on first use (the module
    pulls in torch._dynamo: seconds of import a CPU process never needs). (None, {}) before
    torch 2.9."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta: VarlenMetadata,
                 scale: float) -> torch.Tensor:
    """One FlashAttention call for the batch. torch 2.9-2.10 take `is_causal`; later releases
    spell causal as window_size=(-1, 0) and want enable_gqa=True when K/V have fewer heads
    (the kernel itself always supported grouped heads)."""
    varlen_attn, params = _varlen()
    kwargs: dict = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params and q.shape[1] != keys.shape[1]:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn takes no scale; only 1/sqrt(head_dim) is supported")
    return varlen_attn(q, keys, vals, meta.cu_seq_q, meta.cu_seq_k, meta.max_q, meta.max_k, **kwargs)


def sdpa_varlen(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor, meta: VarlenMetadata,
                scale: float) -> torch.Tensor:
    """The same contract as flash_varlen, through SDPA one sequence at a time (any device and
    dtype): a check of everything but the kernel."""
    out = torch.empty_like(q)
    q0 = k0 = 0
    for q_len, k_len in zip(meta.q_lens, meta.k_lens):
        qpos = torch.arange(k_len - q_len, k_len, device=q.device)
        mask = torch.arange(k_len, device=q.device)[None, :] <= qpos[:, None]  # (q_len, k_len), bottom-right
        o = F.scaled_dot_product_attention(
            q[q0 : q0 + q_len].transpose(0, 1)[None], keys[k0 : k0 + k_len].transpose(0, 1)[None],
            vals[k0 : k0 + k_len].transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True,
        )  # (1, H, q_len, hd)
        out[q0 : q0 + q_len] = o[0].transpose(0, 1)
        q0, k0 = q0 + q_len, k0 + k_len
    return out


def default_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> Kernel | None:
    """The hook that picks the backend: flash_varlen where FlashAttention runs (CUDA, 16-bit,
    head_dim a multiple of 8 up to 256), else None: attention.py's reference path."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or head_dim % 8 or head_dim > 256:
        return None
    return flash_varlen if _varlen()[0] is not None else None
