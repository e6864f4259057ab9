"""A GGUF file's quantized blocks, kept quantized: Q4_0 / Q4_1 as Int4Linear, Q8_0 as
BlockInt8Linear, read byte for byte (no re-quantization; the only rounding is of each
block's float16 scale and offset to the kernels' bfloat16).

Block layouts (ggml), 32 weights of one row per block, rows of the (out, in) matrix:
  Q4_0: f16 d, 16 bytes of nibbles            w = d * (q - 8)
  Q4_1: f16 d, f16 m, 16 bytes of nibbles     w = d * q + m
  Q8_0: f16 d, 32 int8                        w = d * q
Nibble j of a block is byte j's low half for j < 16 and byte j-16's high half otherwise.
"""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

from engine.gguf.header import check_header
from engine.gguf.weights import hf_name, unpermute_rotary
from engine.quant.linear import BlockInt8Linear, Int4Linear, QuantLinear

GROUP = 32
_BLOCK_BYTES = {GGMLQuantizationType.Q4_0: 18, GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


def _f16(blocks: np.ndarray, start: int) -> torch.Tensor:
    return torch.from_numpy(blocks[..., start : start + 2].copy().view(np.float16)[..., 0].astype(np.float32))


def _nibbles(qs: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int32))


def read_blocks(data: np.ndarray, kind: GGMLQuantizationType) -> dict[str, torch.Tensor]:
    """One tensor's blocks as (out, in/32, ...) tensors: Q4 -> q (out, in) in [0,16), scale,
    zero (out, in/32); Q8_0 -> q (out, in/32, 32) int8, d (out, in/32)."""
    blocks = np.asarray(data).reshape(data.shape[0], -1, _BLOCK_BYTES[kind])  # (out, in/32, bytes)
    d = _f16(blocks, 0)
    if kind == GGMLQuantizationType.Q8_0:
        return {"q": torch.from_numpy(blocks[..., 2:].copy().view(np.int8)), "d": d}
    if kind == GGMLQuantizationType.Q4_0:
        q, zero = _nibbles(blocks[..., 2:]), torch.zeros_like(d)
    else:  # Q4_1: d*q + m == d*(q - 8) + (m + 8d)
        q, zero = _nibbles(blocks[..., 4:]), _f16(blocks, 2) + 8 * d
    return {"q": q.reshape(q.shape[0], -1), "scale": d, "zero": zero}


def _unpermute(blocks: dict[str, torch.Tensor], heads: int) -> dict[str, torch.Tensor]:
    # A row permutation: blocks run along the input dim, so whole rows move with their blocks.
    return {k: torch.from_numpy(unpermute_rotary(v.numpy(), heads)) for k, v in blocks.items()}


def _int4(parts: list[dict[str, torch.Tensor]], bias) -> Int4Linear:
    q = torch.cat([p["q"] for p in parts])  # rows of fused projections stack along out
    scale = torch.cat([p["scale"] for p in parts]).t()  # (in/32, out)
    zero = torch.cat([p["zero"] for p in parts]).t()
    return Int4Linear(q, scale, zero, GROUP, bias)


def _int8(parts: list[dict[str, torch.Tensor]], bias) -> BlockInt8Linear:
    q = torch.cat([p["q"] for p in parts]).permute(1, 0, 2)  # (in/32, out, 32)
    d = torch.cat([p["d"] for p in parts]).t()
    return BlockInt8Linear(q, d, bias)


# our fused module -> the HF projections it stacks, in order
_FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
          "self_attn.o_proj": ("self_attn.o_proj",),
          "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "mlp.down_proj": ("mlp.down_proj",)}


def install_gguf_blocks(model: torch.nn.Module, gguf_path: str, architecture: str) -> dict[str, int]:
    """Replace every linear whose GGUF tensors are all Q4_0/Q4_1 (or all Q8_0) by a module
    holding those blocks. Others (K-quants, float tensors, MoE experts) stay as loaded.
    Returns counts by kind for the log."""
    cfg = model.config
    check_header(gguf_path)  # the source may have changed since it was converted: bound it again
    reader = GGUFReader(gguf_path)
    tensors = {hf_name(t.name): t for t in reader.tensors}
    if cfg.tie_word_embeddings and "lm_head.weight" not in tensors:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    counts: dict[str, int] = {}

    def blocks_of(name: str):
        t = tensors.get(name)
        if t is None or t.tensor_type not in _BLOCK_BYTES:
            return None, None
        b = read_blocks(t.data, t.tensor_type)
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            b = _unpermute(b, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
        return t.tensor_type, b

    def replace(parent: torch.nn.Module, attr: str, hf_names: tuple[str, ...]) -> None:
        old = getattr(parent, attr)
        found = [blocks_of(n) for n in hf_names]
        kinds = {k for k, _ in found}
        if len(kinds) != 1 or None in kinds or isinstance(old, QuantLinear):
            return
        kind = kinds.pop()
        parts = [b for _, b in found]
        bias = old.bias.data if getattr(old, "bias", None) is not None else None
        new = _int8(parts, bias) if kind == GGMLQuantizationType.Q8_0 else _int4(parts, bias)
        setattr(parent, attr, new)
        counts[kind.name] = counts.get(kind.name, 0) + 1

    for i, layer in enumerate(model.layers):
        for ours, theirs in _FUSED.items():
            owner_name, attr = ours.split(".")
            owner = getattr(layer, owner_name)
            if hasattr(owner, attr):  # an MoE layer has no gate_up_proj
                replace(owner, attr, tuple(f"model.layers.{i}.{t}.weight" for t in theirs))
    replace(model, "lm_head", ("lm_head.weight",))
    return counts
