"""GGUF tensors as HF-named float32 tensors, dequantized exactly as transformers does.

llama.cpp names tensors `blk.N.attn_q.weight` and so on; transformers' checkpoints name them
`model.layers.N.self_attn.q_proj.weight`. The values come from the `gguf` package's own
dequantizer (the one transformers calls), so a converted checkpoint equals transformers'
`from_pretrained(..., gguf_file=...)` bit for bit.
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from gguf import GGUFReader, dequantize

# llama.cpp's per-layer names -> transformers'.
_LAYER = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint this engine can convert."""


def hf_name(name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, _, kind = name.rpartition(".")
    if stem in _GLOBAL:
        return f"{_GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
    raise GGUFError(f"unknown GGUF tensor {name!r} (only dense llama, qwen2 and qwen3 models are supported)")


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's export permutation of a llama Q or K projection.

    HF's llama rotates the two halves of each head ([x0..x31], [x32..x63]); llama.cpp rotates
    interleaved pairs, so its converter reorders each head's rows from (2, hd/2) to (hd/2, 2).
    This swaps them back, the same reshape transformers' GGUF loader does. w: (heads*hd, in)."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def iter_weights(reader: GGUFReader, architecture: str, num_heads: int,
                 num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
    """(HF name, float32 array in HF's (out, in) layout) for every tensor of the file."""
    for t in reader.tensors:
        name = hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)  # (out, in) or (n,), float32
            if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                w = unpermute_rotary(w, num_heads if "q_proj" in name else num_kv_heads)
        except (ValueError, NotImplementedError) as exc:  # a shape the heads do not divide, a type not dequantized
            raise GGUFError(f"GGUF tensor {t.name!r} (shape {list(t.shape)}, {t.tensor_type.name}) does not convert: "
                            f"{exc}") from None
        # F32 tensors are read-only views of the memory-mapped file: copy them out.
        yield name, np.array(w, dtype=np.float32, order="C", copy=not w.flags.writeable or None)
