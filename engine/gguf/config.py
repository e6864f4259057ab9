"""A GGUF file's metadata as the HF `config.json` transformers would write for the same model."""
from __future__ import annotations

from typing import Any

import numpy as np
from gguf import GGUFReader

from engine.gguf.weights import GGUFError

# llama.cpp architecture -> (transformers class, model_type).
ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


def field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _f32(value: float) -> float:
    """GGUF stores floats as float32: 1e-05 reads back as 9.999999747378752e-06. The shortest
    decimal that rounds to the same float32 is what the original config.json said."""
    return float(str(np.float32(value)))


def hf_config(reader: GGUFReader) -> dict[str, Any]:
    arch = field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    cls, model_type = ARCHITECTURES[arch]

    def meta(key: str, default: Any = None) -> Any:
        return field(reader, f"{arch}.{key}", default)

    heads = meta("attention.head_count")
    hidden = meta("embedding_length")
    names = {t.name for t in reader.tensors}
    vocab = meta("vocab_size") or len(field(reader, "tokenizer.ggml.tokens", []))
    eos = field(reader, "tokenizer.ggml.eos_token_id")
    theta = _f32(meta("rope.freq_base", 10000.0))
    cfg: dict[str, Any] = {
        "architectures": [cls], "model_type": model_type,
        "hidden_size": hidden, "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length") or meta("rope.dimension_count") or hidden // heads,
        "rms_norm_eps": _f32(meta("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta, "rope_parameters": {"rope_type": "default", "rope_theta": theta},
        "max_position_embeddings": meta("context_length", 4096), "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in names, "hidden_act": "silu",
        "bos_token_id": field(reader, "tokenizer.ggml.bos_token_id"), "eos_token_id": eos,
        "torch_dtype": "float32",
    }
    if arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    if arch in ("qwen2", "qwen3"):
        cfg.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg["num_hidden_layers"])
    if arch == "qwen3":
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    return cfg
