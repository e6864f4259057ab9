"""Attention over the paged KV cache.

The batch packs tokens as [decode tokens (one per sequence, by context length) | prefill
chunks]. New K/V are
written into the cache at `slot_mapping`; every query then reads its sequence's keys
through its block table, so prefix-cached and chunk-continued prompts see their history.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.models.varlen_attention import VarlenMetadata, varlen_attention


@dataclass
class PrefillSpan:
    q_start: int  # offset of this chunk's first token in the packed batch
    q_len: int
    context_len: int  # tokens with KV after this chunk (cached + earlier chunks + this one)
    block_table: torch.Tensor  # (nb,) block ids covering context_len


@dataclass
class DecodeGroup:
    """Consecutive sequences each adding q_len tokens (1: decodes; more: speculative verifications,
    engine/spec), attended in one call."""

    start: int  # offset of the group's first token in the packed batch
    block_tables: torch.Tensor  # (D, MB), padded with block 0
    # (D, 1, q_len, MB*bs) True where a query sees a key (real and causal); None if all see all.
    mask: torch.Tensor | None
    # Set when the group is one sequence whose blocks are consecutive ids from this one: its
    # keys are then a view of the pool, with no gather (blocks come off the free list in runs).
    first_block: int | None = None
    q_len: int = 1


@dataclass
class AttentionMetadata:
    """Everything attention needs about the batch; built by ModelRunner, read-only here."""

    slot_mapping: torch.Tensor  # (T,) flat cache slot of each new token
    block_size: int
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    varlen: VarlenMetadata | None = None  # set: the whole batch in one varlen call instead


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    # caches: (NB, bs, Hkv, hd); k, v: (T, Hkv, hd)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: (T, H, hd), k/v: (T, Hkv, hd) for the new tokens. Returns (T, H, hd)."""
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    if meta.varlen is not None:  # CUDA bfloat16/float16 (varlen_attention.py)
        return varlen_attention(q, k_cache, v_cache, meta.varlen, scale)
    out = torch.empty_like(q)
    for group in meta.decodes:
        s = slice(group.start, group.start + group.block_tables.shape[0] * group.q_len)
        out[s] = _decode(q[s], k_cache, v_cache, group, scale)
    for span in meta.prefills:
        s = slice(span.q_start, span.q_start + span.q_len)
        out[s] = _prefill(q[s], k[s], v[s], k_cache, v_cache, span, scale)
    return out


def _gather(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """(NB, bs, Hkv, hd) gathered by a (..., nb) block table -> (..., nb*bs, Hkv, hd).

    index_select copies whole blocks as rows: ~4x faster on CPU than advanced indexing."""
    g = cache.index_select(0, block_table.reshape(-1))
    return g.view(*block_table.shape[:-1], block_table.shape[-1] * cache.shape[1], *cache.shape[2:])


def _decode(q, k_cache, v_cache, group: DecodeGroup, scale: float) -> torch.Tensor:
    t, h, hd = q.shape
    hkv, ql = k_cache.shape[2], group.q_len
    d = t // ql
    if group.first_block is not None:
        blocks = slice(group.first_block, group.first_block + group.block_tables.shape[1])
        keys = k_cache[blocks].reshape(1, -1, hkv, hd).transpose(1, 2)  # (1, Hkv, S, hd), a view
        vals = v_cache[blocks].reshape(1, -1, hkv, hd).transpose(1, 2)
    else:
        keys = _gather(k_cache, group.block_tables).transpose(1, 2)  # (D, Hkv, S, hd)
        vals = _gather(v_cache, group.block_tables).transpose(1, 2)
    # The heads sharing a KV head become rows of that head's query matrix (q_len x G rows), so
    # GQA needs no repeated keys.
    g = h // hkv
    qg = q.view(d, ql, hkv, g, hd).transpose(1, 2).reshape(d, hkv, ql * g, hd)  # (D, Hkv, Q*G, hd)
    mask = group.mask
    if mask is not None and ql > 1:
        mask = mask[:, :, :, None, :].expand(-1, -1, -1, g, -1).reshape(d, 1, ql * g, mask.shape[-1])
    out = F.scaled_dot_product_attention(qg, keys, vals, attn_mask=mask, scale=scale)  # (D, Hkv, Q*G, hd)
    return out.view(d, hkv, ql, g, hd).transpose(1, 2).reshape(t, h, hd)


def _prefill(q, k, v, k_cache, v_cache, span: PrefillSpan, scale: float) -> torch.Tensor:
    t, h, hd = q.shape
    if span.context_len == span.q_len:  # no history: attend to this chunk's own K/V
        keys, vals, mask, causal = k, v, None, True
    else:
        keys = _gather(k_cache, span.block_table)[: span.context_len]  # (S, Hkv, hd)
        vals = _gather(v_cache, span.block_table)[: span.context_len]
        # Query i sits at absolute position context_len - q_len + i (bottom-right causal).
        qpos = torch.arange(span.context_len - t, span.context_len, device=q.device)
        mask = torch.arange(span.context_len, device=q.device)[None, :] <= qpos[:, None]  # (t, S)
        causal = False
    # A leading batch dim matters: with 3-D inputs CPU SDPA falls back to its slow math path.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], keys.transpose(0, 1)[None], vals.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=True,
    )  # (1, H, t, hd)
    return out[0].transpose(0, 1)
