"""A GGUF file's tokenizer metadata as the HF `tokenizer.json` and `tokenizer_config.json`.

llama.cpp's export keeps the BPE vocabulary and merges but names the pre-tokenizer by one
word (`tokenizer.ggml.pre`) and drops the normalizer. Both are restored here from what the
original tokenizer.json of each family says: Qwen's NFC normalizer and split regex,
SmolLM's one-digit-per-token split, Llama 3's regex.
"""
from __future__ import annotations

import json
from typing import Any

from gguf import GGUFReader
from tokenizers import Tokenizer

from engine.gguf.metadata import Metadata
from engine.gguf.weights import GGUFError

CONTROL, USER_DEFINED = 3, 4  # gguf.TokenType values that make an added token

_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level(add_prefix_space: bool, trim_offsets: bool, use_regex: bool) -> dict[str, Any]:
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": trim_offsets,
            "use_regex": use_regex}


def _split(pattern: str) -> list[dict[str, Any]]:
    return [{"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
            _byte_level(False, False, False)]


# tokenizer.ggml.pre -> (normalizer, pre-tokenizers, byte-level post/decoder settings)
_PRE: dict[str, tuple[dict | None, list[dict[str, Any]], dict[str, Any]]] = {
    "smollm": (None, [{"type": "Digits", "individual_digits": True}, _byte_level(False, True, True)],
               _byte_level(True, True, True)),
    "qwen2": ({"type": "NFC"}, _split(_QWEN2_SPLIT), _byte_level(False, False, False)),
    "llama-bpe": (None, _split(_LLAMA3_SPLIT), _byte_level(True, False, True)),
    "gpt-2": (None, [_byte_level(False, True, True)], _byte_level(True, True, True)),
}


def tokenizer_json(reader: GGUFReader) -> dict[str, Any]:
    m = Metadata(reader)
    model = m.string("tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = m.string("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(_PRE)}")
    normalizer, pre_tokenizers, byte_level = _PRE[pre]
    tokens = m.strings("tokenizer.ggml.tokens")
    types = m.integers("tokenizer.ggml.token_type", None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"GGUF metadata 'tokenizer.ggml.token_type' has {len(types)} entries for {len(tokens)} "
                        "tokens; the file is malformed: re-export it")
    merges = [pair.split(" ", 1) for pair in m.strings("tokenizer.ggml.merges")]
    if (bad := next((i for i, pair in enumerate(merges) if len(pair) != 2), None)) is not None:
        raise GGUFError(f"GGUF metadata 'tokenizer.ggml.merges'[{bad}] ({merges[bad][0]!r}) is not two tokens "
                        "joined by a space; the file is malformed: re-export it")
    added = [{"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind == CONTROL}
             for i, (tok, kind) in enumerate(zip(tokens, types)) if kind in (CONTROL, USER_DEFINED)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {tok: i for i, tok in enumerate(tokens)}, "merges": merges},
    }


def tokenizer_config(reader: GGUFReader, max_length: int) -> dict[str, Any]:
    m = Metadata(reader)
    tokens = m.strings("tokenizer.ggml.tokens")

    def token(key: str) -> str | None:
        # Any integer: an id outside the vocabulary (some exports write -1 for "none") names no token.
        i = m.integer(f"tokenizer.ggml.{key}_token_id", None, minimum=-(1 << 63), maximum=1 << 64)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": m.string("tokenizer.chat_template", None),
        "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
        "unk_token": token("unknown"), "add_bos_token": m.flag("tokenizer.ggml.add_bos_token", False),
        "add_eos_token": False, "clean_up_tokenization_spaces": False, "model_max_length": max_length,
    }


def build_tokenizer(reader: GGUFReader) -> tuple[str, dict[str, Any]]:
    """tokenizer.json's text (checked by loading it) and tokenizer_config.json's content."""
    text = json.dumps(tokenizer_json(reader), ensure_ascii=False)
    try:  # fails here, not at serve time, if the restored pieces do not fit
        Tokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises a bare Exception
        raise GGUFError(f"GGUF metadata 'tokenizer.ggml.tokens' and 'tokenizer.ggml.merges' do not form a "
                        f"tokenizer ({exc}); the file is malformed: re-export it") from None
    m = Metadata(reader)
    return text, tokenizer_config(reader, m.integer(f"{m.string('general.architecture')}.context_length", 4096))
