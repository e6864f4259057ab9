"""What both ends of a pair must agree on, and the checks that enforce it."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kv_transfer.checksum import ChecksumAlgo
from kv_transfer.errors import LayoutMismatch, RefuseReason
from kv_transfer.header import DraftSection, TransferHeader, draft_model_key


@dataclass(frozen=True)
class KVLayout:
    """One model's paged KV cache layout, as the engine holds it:
    kv_cache (2, num_layers, num_blocks_in_pool, block_size, num_kv_heads, head_dim)."""

    model_id: str
    num_layers: int
    num_kv_heads: int  # the model's total KV heads, not a TP shard's
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @classmethod
    def from_kv_cache(cls, model_id: str, kv_cache: torch.Tensor) -> KVLayout:
        """The layout of an engine's whole (unsharded) KV cache tensor."""
        _, layers, _, block_size, heads, head_dim = kv_cache.shape
        return cls(model_id, layers, heads, head_dim, block_size, kv_cache.dtype)

    @classmethod
    def of_model(cls, model_id: str, kv_cache: torch.Tensor, num_kv_heads: int) -> KVLayout:
        """The whole model's layout, from an engine's KV cache that may hold only a TP rank's heads."""
        _, layers, _, block_size, _, head_dim = kv_cache.shape
        return cls(model_id, layers, num_kv_heads, head_dim, block_size, kv_cache.dtype)


@dataclass(frozen=True)
class HeadShard:
    """Which KV heads one rank holds: [head_start, head_start + head_count) of the model's
    heads, on rank tp_rank of tp_size. TP=1 holds all of them (`HeadShard.full`)."""

    tp_size: int
    tp_rank: int
    head_start: int
    head_count: int

    @classmethod
    def full(cls, num_kv_heads: int) -> HeadShard:
        return cls(1, 0, 0, num_kv_heads)


def draft_layout(engine) -> KVLayout | None:
    """The layout of an engine's draft model whose prompt KV travels with the target's
    (engine.LLMEngine.draft_kv), or None when none does."""
    draft = engine.draft_kv
    return None if draft is None else KVLayout.from_kv_cache(draft.model_id, draft.runner.kv_cache)


def make_header(request_id: str, kv: torch.Tensor, num_tokens: int, layout: KVLayout, shard: HeadShard,
                checksum: tuple[ChecksumAlgo, int], draft: DraftSection | None = None) -> TransferHeader:
    """The header for sending `kv` (2, L, nb, bs, head_count, hd), and the draft's KV when `draft`
    (make_draft_section) says so; LayoutMismatch if the tensor does not match the sender's own
    layout and shard."""
    nb = math.ceil(num_tokens / layout.block_size) if num_tokens > 0 else 0
    want = (2, layout.num_layers, nb, layout.block_size, shard.head_count, layout.head_dim)
    if tuple(kv.shape) != want:
        raise LayoutMismatch(RefuseReason.SHAPE, f"kv shape {tuple(kv.shape)} for {num_tokens} tokens, "
                                                 f"expected {want}")
    if kv.dtype != layout.dtype:
        raise LayoutMismatch(RefuseReason.DTYPE, f"kv dtype {kv.dtype}, layout says {layout.dtype}")
    algo, value = checksum
    return TransferHeader(request_id, layout.model_id, layout.num_layers, layout.num_kv_heads,
                          layout.head_dim, layout.block_size, layout.dtype, num_tokens, nb, shard.tp_size,
                          shard.tp_rank, shard.head_start, shard.head_count, kv.numel() * kv.element_size(),
                          int(algo), value, draft)


def make_draft_section(kv: torch.Tensor, num_tokens: int, layout: KVLayout, checksum: int) -> DraftSection:
    """The header's draft section for the draft model's KV `kv` (2, L', nb, bs, H', hd') of
    `num_tokens` tokens in the draft's own `layout`; LayoutMismatch if the tensor does not match it."""
    nb = math.ceil(num_tokens / layout.block_size)
    want = (2, layout.num_layers, nb, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if tuple(kv.shape) != want or kv.dtype != layout.dtype:
        raise LayoutMismatch(RefuseReason.SHAPE, f"draft kv {tuple(kv.shape)} {kv.dtype} for {num_tokens} tokens, "
                                                 f"expected {want} {layout.dtype}")
    return DraftSection(draft_model_key(layout.model_id), layout.num_layers, layout.num_kv_heads, layout.head_dim,
                        layout.dtype, num_tokens, nb, kv.numel() * kv.element_size(), checksum)


def check_draft(h: TransferHeader, layout: KVLayout | None) -> str | None:
    """None if a receiver whose draft model has `layout` can take the header's draft KV as it is;
    otherwise why not. Not a refusal: the target's KV is still good, the draft just recomputes."""
    d = h.draft
    if d is None:
        return "no draft section"
    if layout is None:
        return "this receiver has no draft model"
    if d.model_key != draft_model_key(layout.model_id):
        return f"another draft model than {layout.model_id!r}"
    got, want = (d.num_layers, d.num_kv_heads, d.head_dim, h.block_size, d.dtype), \
        (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size, layout.dtype)
    if got != want:
        return f"draft (layers, kv_heads, head_dim, block_size, dtype) {got}, expected {want}"
    return None


def check_header(h: TransferHeader, layout: KVLayout, shard: HeadShard,
                 device: torch.device) -> LayoutMismatch | None:
    """None if a receiver holding `layout`/`shard` with its buffer on `device` can take this
    payload as it is; otherwise the mismatch to refuse with. Reads only the header."""
    if h.model_id != layout.model_id:
        return LayoutMismatch(RefuseReason.MODEL, f"model {h.model_id!r}, expected {layout.model_id!r}")
    got = (h.num_layers, h.num_kv_heads, h.head_dim, h.block_size)
    want = (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size)
    if got != want:
        return LayoutMismatch(RefuseReason.SHAPE,
                              f"(layers, kv_heads, head_dim, block_size) {got}, expected {want}")
    if h.dtype != layout.dtype:
        return LayoutMismatch(RefuseReason.DTYPE, f"dtype {h.dtype}, expected {layout.dtype}")
    from kv_transfer.reshard import is_planned  # reshard builds on HeadShard, defined here

    sender = HeadShard(h.tp_size, h.tp_rank, h.head_start, h.head_count)
    same = (h.head_start, h.head_count) == (shard.head_start, shard.head_count)
    if not (same or is_planned(layout.num_kv_heads, sender, shard)):
        # Between different TP sizes only the pieces reshard.plan assigns this rank may come in.
        return LayoutMismatch(RefuseReason.HEAD_RANGE,
                              f"heads [{h.head_start}, {h.head_start + h.head_count}) from rank {h.tp_rank} of "
                              f"TP {h.tp_size}: not a piece for rank {shard.tp_rank} of TP {shard.tp_size}, which "
                              f"holds [{shard.head_start}, {shard.head_start + shard.head_count})")
    if h.checksum_algo == ChecksumAlgo.XXH3_64 and device.type != "cpu":
        return LayoutMismatch(RefuseReason.CHECKSUM_ALGO, f"XXH3_64 cannot be checked on {device} in place")
    return None
