"""Built-in model presets: small random-weight checkpoints that need no download.

Serving, tests and benchmarks need a model on machines with no network and no HF token.
A preset is generated from a seed and a tokenizer shipped in this package, then cached on
disk in ordinary HF format, so every loader (ours, transformers) reads it like any other
checkpoint. Generation is byte-identical on every machine: the checkpoint's sha256 is a
model id that prefill and decode workers on different hosts agree on.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

# Bump when the files a preset produces change, so stale caches are never reused.
FORMAT_VERSION = 1
MARKER = ".complete"
ASSETS = Path(__file__).resolve().parent / "assets" / "tokenizers"
# Facts about the shipped tokenizers (tests check them against the files), kept here so
# that importing this module does not parse a megabyte of JSON.
TOKENIZER_SIZES = {"bpe-4k": 4096, "bpe-32k": 32000}
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Init scale, chosen so that greedy output depends on the whole context: matrices get
# std 1/sqrt(fan_in), so each layer adds an O(1) update that dominates the embedding (with
# tiny std the residual stays ~ the input embedding and, with tied weights, greedy decoding
# just repeats the last token). Embeddings get std LOGIT_STD/sqrt(hidden): logits then have
# std ~LOGIT_STD, peaked enough that argmax survives bf16 noise, flat enough not to loop.
LOGIT_STD = 1.5


class ModelNotFound(ValueError):
    """`--model` named neither a preset nor a checkpoint directory."""


@dataclass(frozen=True)
class PresetSpec:
    """One preset: `config` is the HF config.json content, written as is."""

    name: str
    architecture: str
    config: dict[str, Any]
    tokenizer: str  # directory name under engine/assets/tokenizers/
    seed: int


def _qwen3_config(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
                  intermediate: int, tokenizer: str, **extra: Any) -> dict[str, Any]:
    rope_theta = 10000.0
    vocab = -(-TOKENIZER_SIZES[tokenizer] // 64) * 64  # padded like real checkpoints
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": intermediate,
        "vocab_size": vocab, "max_position_embeddings": 4096, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
        "attention_dropout": 0.0, "use_sliding_window": False, "sliding_window": None,
        "max_window_layers": layers, "initializer_range": 0.02, "use_cache": True,
        # transformers 4.x reads rope_theta, 5.x reads rope_parameters.
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "bos_token_id": None, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID,
        "torch_dtype": "float32",
        **extra,
    }


def _moe_extra(experts: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        # num_experts is Qwen's name; num_local_experts is what Mixtral-style readers expect.
        "num_experts": experts, "num_local_experts": experts, "num_experts_per_tok": 2,
        "moe_intermediate_size": 128, "norm_topk_prob": True, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "output_router_logits": False, "router_aux_loss_coef": 0.001,
    }


PRESETS: dict[str, PresetSpec] = {
    spec.name: spec
    for spec in (
        PresetSpec("tiny", "Qwen3ForCausalLM",
                   _qwen3_config(128, 2, 4, 2, 32, 384, "bpe-4k"), "bpe-4k", seed=0),
        PresetSpec("tiny-moe", "Qwen3MoeForCausalLM",
                   _qwen3_config(128, 2, 4, 2, 32, 384, "bpe-4k", **_moe_extra(4)), "bpe-4k", seed=1),
        # A draft for speculative decoding tests: `tiny`'s vocabulary (same tokenizer), a quarter of its work.
        PresetSpec("tiny-draft", "Qwen3ForCausalLM",
                   _qwen3_config(64, 1, 2, 1, 32, 192, "bpe-4k"), "bpe-4k", seed=3),
        PresetSpec("bench", "Qwen3ForCausalLM",
                   _qwen3_config(512, 8, 8, 2, 64, 1536, "bpe-32k"), "bpe-32k", seed=2),
        # `bench`'s draft (benchmarks/spec_bench.py, disaggregated draft KV): its vocabulary, ~1/8 of its work.
        PresetSpec("bench-draft", "Qwen3ForCausalLM",
                   _qwen3_config(256, 2, 4, 2, 64, 768, "bpe-32k"), "bpe-32k", seed=4),
    )
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("BRIGADE_CACHE_DIR") or Path.home() / ".cache" / "brigade")


def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes exactly as transformers' save_pretrained writes them."""
    h, hd = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
        })
        experts = config.get("num_experts", 0)
        if experts and i not in config["mlp_only_layers"] and (i + 1) % config["decoder_sparse_step"] == 0:
            shapes[p + "mlp.gate.weight"] = (experts, h)
            mlps = [(f"{p}mlp.experts.{e}.", config["moe_intermediate_size"]) for e in range(experts)]
        else:
            mlps = [(p + "mlp.", config["intermediate_size"])]
        for mp, inter in mlps:
            shapes.update({mp + "gate_proj.weight": (inter, h), mp + "up_proj.weight": (inter, h),
                           mp + "down_proj.weight": (h, inter)})
    shapes["model.norm.weight"] = (h,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], h)
    return shapes


def _init(spec: PresetSpec, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """One tensor, seeded from (preset, tensor name) so generation order does not matter.

    Uniform with the target std rather than normal: numpy's float32 uniform is exact integer
    arithmetic, while its normal sampler calls libm (log1pf/exp), which may differ in the
    last bit between platforms and would break byte-identical checkpoints. For the same
    reason scales use math.sqrt (correctly rounded everywhere) and float32 ops only.
    """
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)  # RMSNorm weights
    digest = hashlib.sha256(f"{spec.name}:{spec.seed}:{name}".encode()).digest()
    rng = np.random.Generator(np.random.PCG64(int.from_bytes(digest[:16], "little")))
    std = (LOGIT_STD if name.endswith("embed_tokens.weight") else 1.0) / math.sqrt(shape[1])
    w = rng.random(shape, dtype=np.float32)  # [0, 1)
    w -= np.float32(0.5)
    w *= np.float32(std * math.sqrt(12.0))  # uniform(-a, a) has std a / sqrt(3)
    return w


def _dump_json(obj: Any, path: Path) -> None:
    path.write_bytes((json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def _write_checkpoint(spec: PresetSpec, out: Path) -> None:
    _dump_json(spec.config, out / "config.json")
    _dump_json({"bos_token_id": None, "eos_token_id": IM_END_ID, "pad_token_id": ENDOFTEXT_ID},
               out / "generation_config.json")
    shutil.copyfile(ASSETS / spec.tokenizer / "tokenizer.json", out / "tokenizer.json")
    _dump_json({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "add_bos_token": False, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": spec.config["max_position_embeddings"],
    }, out / "tokenizer_config.json")
    tensors = {n: _init(spec, n, s) for n, s in weight_shapes(spec.config).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})


def checkpoint_sha256(path: Path) -> str:
    """sha256 over the sorted relative names, sizes and bytes of a checkpoint's files."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(path).rglob("*") if p.is_file() and p.name != MARKER)
    for f in files:
        h.update(f.relative_to(path).as_posix().encode() + b"\0")
        h.update(f.stat().st_size.to_bytes(8, "little"))
        with f.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


def materialize(name: str, cache_dir: Path | None = None) -> Path:
    """Return `<cache_dir>/presets/<name>-v<FORMAT_VERSION>/`, generating it if needed.

    Built in a temp dir beside the target and renamed into place, so a reader never sees a
    half-written checkpoint and concurrent processes may race: the first rename wins and the
    others discard their identical copy. The marker file is written last, before the rename.
    """
    if name not in PRESETS:
        raise ModelNotFound(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    root = Path(cache_dir or default_cache_dir()) / "presets"
    final = root / f"{name}-v{FORMAT_VERSION}"
    if (final / MARKER).is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        _write_checkpoint(PRESETS[name], tmp)
        (tmp / MARKER).write_text(checkpoint_sha256(tmp) + "\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():
                # An unmarked dir is debris (e.g. hand-edited): move it aside, take its place.
                stale = Path(tempfile.mkdtemp(prefix=f".{final.name}.stale.", dir=root))
                os.rename(final, stale / "old")
                shutil.rmtree(stale, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # no-op once renamed
    return final


def resolve_model(name_or_path: str, cache_dir: Path | None = None) -> Path:
    """Map a `--model` value to a checkpoint directory: a preset name, a registry model (pulled
    and converted on first use), a GGUF file (converted into the cache on first use), or an
    HF-format dir."""
    from engine.registry import REGISTRY

    if name_or_path in PRESETS:
        return materialize(name_or_path, cache_dir)
    if name_or_path in REGISTRY:
        return _pull_on_first_use(name_or_path, cache_dir)
    path = Path(name_or_path).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_checkpoint(path, cache_dir)
    if (path / "config.json").is_file():
        return path
    raise ModelNotFound(
        f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}), a registry model "
        f"({', '.join(REGISTRY)}; see 'brigade models list'), a .gguf file, nor a directory "
        "with config.json (an HF-format checkpoint: config.json, *.safetensors, tokenizer.json)"
    )


def _pull_on_first_use(name: str, cache_dir: Path | None) -> Path:
    from engine.registry import is_pulled, pull
    from engine.registry.progress import RichPullProgress

    if is_pulled(name, cache_dir=cache_dir):
        return pull(name, cache_dir=cache_dir)
    with RichPullProgress(f"pulling {name} (first use; 'brigade models pull' does this ahead)") as progress:
        return pull(name, cache_dir=cache_dir, progress=progress)


def _gguf_checkpoint(path: Path, cache_dir: Path | None) -> Path:
    """A GGUF file's HF-layout conversion, cached by the file's name, size and mtime."""
    from engine.gguf import convert_atomically

    st = path.resolve().stat()
    key = hashlib.sha256(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    final = Path(cache_dir or default_cache_dir()) / "gguf-converted" / f"{path.stem}-{key}"
    return convert_atomically(path, final)
