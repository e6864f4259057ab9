"""GGUF files for tests: a tiny, whole, convertible llama written with the gguf package's own
GGUFWriter (1 layer, hidden 8, 2 heads, a 3-token byte-level BPE vocabulary)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType as T
from gguf import GGUFWriter

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 8, 16, 2, 1, 3
KEYS: dict[str, tuple[T, Any]] = {
    "llama.block_count": (T.UINT32, 1), "llama.context_length": (T.UINT32, 64),
    "llama.embedding_length": (T.UINT32, HIDDEN), "llama.feed_forward_length": (T.UINT32, FFN),
    "llama.attention.head_count": (T.UINT32, HEADS), "llama.attention.head_count_kv": (T.UINT32, KV_HEADS),
    "llama.rope.freq_base": (T.FLOAT32, 10000.0), "llama.attention.layer_norm_rms_epsilon": (T.FLOAT32, 1e-5),
    "tokenizer.ggml.model": (T.STRING, "gpt2"), "tokenizer.ggml.pre": (T.STRING, "gpt-2"),
    "tokenizer.ggml.tokens": (T.ARRAY, ["a", "b", "ab"]), "tokenizer.ggml.token_type": (T.ARRAY, [1, 1, 1]),
    "tokenizer.ggml.merges": (T.ARRAY, ["a b"]),
    "tokenizer.ggml.bos_token_id": (T.UINT32, 0), "tokenizer.ggml.eos_token_id": (T.UINT32, 1),
}
TENSORS = {"token_embd.weight": (VOCAB, HIDDEN), "output_norm.weight": (HIDDEN,),
           "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.ffn_norm.weight": (HIDDEN,),
           "blk.0.attn_q.weight": (HIDDEN, HIDDEN), "blk.0.attn_k.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN),
           "blk.0.attn_v.weight": (HIDDEN // HEADS * KV_HEADS, HIDDEN), "blk.0.attn_output.weight": (HIDDEN, HIDDEN),
           "blk.0.ffn_gate.weight": (FFN, HIDDEN), "blk.0.ffn_up.weight": (FFN, HIDDEN),
           "blk.0.ffn_down.weight": (HIDDEN, FFN)}


def tiny_llama(path: Path, drop: tuple[str, ...] = (), **override: tuple[T, Any]) -> Path:
    """A whole, convertible llama GGUF; `override` sets keys (dots spelled `__`) to other types or values."""
    w = GGUFWriter(str(path), "llama")
    keys = {**KEYS, **{k.replace("__", "."): v for k, v in override.items()}}
    for key, (kind, value) in keys.items():
        if key not in drop:
            w.add_key_value(key, value, kind)
    rng = np.random.default_rng(0)
    for name, shape in TENSORS.items():
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
