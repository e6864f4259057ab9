"""A GGUF file's metadata as the HF `config.json` transformers would write for the same model."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader

from engine.gguf.metadata import Metadata
from engine.gguf.weights import GGUFError

# llama.cpp architecture -> (transformers class, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-05 reads back as 9.999999747378752e-06. The shortest
    decimal that rounds to the same float32 is what the original config.json said."""
    return float(str(np.float32(value)))


def token_id(m: Metadata, role: str, vocab: int) -> int | None:
    """tokenizer.ggml.<role>_token_id, which must name a token of the vocabulary."""
    return m.integer(f"tokenizer.ggml.{role}_token_id", None, minimum=0, maximum=vocab - 1)


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    m = Metadata(reader)
    arch = m.string("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    cls, model_type = ARCHITECTURES[arch]
    heads = m.integer(f"{arch}.attention.head_count")
    kv_heads = m.integer(f"{arch}.attention.head_count_kv", heads)
    if heads % kv_heads:
        raise GGUFError(f"GGUF metadata '{arch}.attention.head_count_kv' ({kv_heads}) must divide "
                        f"'{arch}.attention.head_count' ({heads}); the file is malformed: re-export it")
    hidden = m.integer(f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = m.integer(f"{arch}.vocab_size", None) or len(m.strings("tokenizer.ggml.tokens"))
    if not vocab:
        raise GGUFError("GGUF metadata 'tokenizer.ggml.tokens' is empty: the file carries no vocabulary")
    theta = _f32(m.number(f"{arch}.rope.freq_base", 10000.0))
    head_dim = (m.integer(f"{arch}.attention.key_length", None) or m.integer(f"{arch}.rope.dimension_count", None)
                or hidden // heads)
    layers = m.integer(f"{arch}.block_count")
    cfg: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": m.integer(f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": _f32(m.number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": m.integer(f"{arch}.context_length", 4096), "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "bos_token_id": token_id(m, "bos", vocab), "eos_token_id": token_id(m, "eos", vocab),
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    if arch == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg
