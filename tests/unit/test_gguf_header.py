"""Hostile and malformed GGUF files are refused with a GGUFError naming the key (or tensor),
before the `gguf` package's reader spends memory on them; a well-formed tiny model converts.

The files are made here: the tiny llama of tests/gguf_files.py (GGUFWriter's output, then
one key overridden, or the bytes cut or flipped), and headers the writer would never write
(counts and lengths from a hostile file) built by hand with struct.
"""
from __future__ import annotations

import json
import random
import struct
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFValueType as T
from gguf_files import HEADS, KV_HEADS, VOCAB, tiny_llama

from engine.gguf import GGUFError, convert_atomically
from engine.gguf.header import (
    MAX_ARRAY_DEPTH,
    MAX_ARRAY_ITEMS,
    MAX_KVS,
    MAX_STRING_BYTES,
    MAX_TENSORS,
    MAX_TOTAL_ITEMS,
    check_header,
)


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def hand_made(path: Path, *kvs: bytes, tensors: int = 0, kv_count: int | None = None, tail: bytes = b"") -> Path:
    """A GGUF v3 header holding exactly the given key/values (counts may lie)."""
    count = len(kvs) if kv_count is None else kv_count
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, tensors, count) + b"".join(kvs) + tail)
    return path


def refused(path: Path, match: str) -> GGUFError:
    out = path.parent / "out"
    with pytest.raises(GGUFError, match=match) as err:
        convert_atomically(path, out)
    assert not out.exists() and [p.name for p in path.parent.iterdir()] == [path.name]  # nothing half-written
    return err.value


def test_a_tiny_well_formed_model_converts(tmp_path: Path) -> None:
    out = convert_atomically(tiny_llama(tmp_path / "m.gguf"), tmp_path / "out")
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (HEADS, KV_HEADS, 4)
    assert (cfg["vocab_size"], cfg["eos_token_id"], cfg["num_hidden_layers"]) == (VOCAB, 1, 1)


def test_a_million_item_array_is_refused_before_it_is_parsed(tmp_path: Path) -> None:
    """1 MB on disk; GGUFReader would build a numpy view per item (~1 GB, 10 s)."""
    path = hand_made(tmp_path / "big.gguf", kv("junk.bytes", T.ARRAY, struct.pack("<IQ", T.UINT8, 1_000_000)
                                               + bytes(1_000_000)))
    tracemalloc.start()
    try:
        refused(path, rf"'junk.bytes': an array of 1000000 items; at most {MAX_ARRAY_ITEMS}")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated while refusing a 1 MB file"


@pytest.mark.parametrize(("override", "key", "why"), [
    ({"llama__attention__head_count": (T.UINT32, 0)}, "llama.attention.head_count", "an integer from 1"),
    ({"llama__attention__head_count": (T.STRING, "8")}, "llama.attention.head_count", "not STRING '8'"),
    ({"llama__attention__head_count": (T.INT32, -2)}, "llama.attention.head_count", "an integer from 1"),
    ({"llama__attention__head_count": (T.UINT64, 1 << 40)}, "llama.attention.head_count", "to 16777216"),
    ({"llama__attention__head_count": (T.ARRAY, [2, 2])}, "llama.attention.head_count", "an array"),
    ({"llama__attention__head_count_kv": (T.UINT32, 3)}, "llama.attention.head_count_kv", "must divide"),
    ({"llama__block_count": (T.FLOAT32, 1.0)}, "llama.block_count", "an integer"),
    ({"llama__rope__freq_base": (T.FLOAT32, float("nan"))}, "llama.rope.freq_base", "positive finite"),
    ({"llama__attention__layer_norm_rms_epsilon": (T.FLOAT32, -1.0)}, "llama.attention.layer_norm_rms_epsilon",
     "positive finite"),
    ({"general__architecture": (T.UINT32, 7)}, "general.architecture", "a string"),
    ({"tokenizer__ggml__eos_token_id": (T.UINT32, 99)}, "tokenizer.ggml.eos_token_id", "from 0 to 2"),
    ({"tokenizer__ggml__tokens": (T.ARRAY, [1, 2, 3])}, "tokenizer.ggml.tokens", "an array of strings"),
    ({"tokenizer__ggml__tokens": (T.STRING, "abc")}, "tokenizer.ggml.tokens", "an array of strings"),
    ({"tokenizer__ggml__token_type": (T.ARRAY, [1, 1])}, "tokenizer.ggml.token_type", "2 entries for 3"),
    ({"tokenizer__ggml__token_type": (T.ARRAY, ["x", "y", "z"])}, "tokenizer.ggml.token_type", "of integers"),
    ({"tokenizer__ggml__merges": (T.ARRAY, ["ab"])}, r"tokenizer.ggml.merges'\[0\]", "not two tokens"),
    ({"tokenizer__ggml__merges": (T.ARRAY, ["a c"])}, "tokenizer.ggml.merges", "do not form a tokenizer"),
    ({"tokenizer__ggml__model": (T.UINT32, 5)}, "tokenizer.ggml.model", "a string"),
    ({"tokenizer__ggml__add_bos_token": (T.UINT32, 1)}, "tokenizer.ggml.add_bos_token", "a bool"),
    ({"tokenizer__chat_template": (T.ARRAY, ["{{ x }}"])}, "tokenizer.chat_template", "a string"),
])
def test_metadata_of_the_wrong_type_or_range_is_refused_naming_the_key(tmp_path: Path, override, key, why) -> None:
    refused(tiny_llama(tmp_path / "m.gguf", **override), f"'{key}.*{why}")


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.attention.head_count", "tokenizer.ggml.tokens",
                                 "tokenizer.ggml.merges", "general.architecture"])
def test_a_missing_required_key_is_named(tmp_path: Path, key: str) -> None:
    path = tiny_llama(tmp_path / "m.gguf")
    if key == "general.architecture":  # GGUFWriter always writes it: rename it in the bytes
        path.write_bytes(path.read_bytes().replace(b"general.architecture", b"general.architecturX"))
    else:
        path = tiny_llama(path, drop=(key,))
    refused(path, f"'{key}' is missing")


@pytest.mark.parametrize(("build", "match"), [
    (lambda p: hand_made(p, kv_count=1 << 63), f"kv_count: {1 << 63} metadata keys; at most {MAX_KVS}"),
    (lambda p: hand_made(p, tensors=1 << 40), f"tensor_count: {1 << 40} tensors; at most {MAX_TENSORS}"),
    (lambda p: hand_made(p, kv_count=3), "key #0: ends at byte 24, inside its own header"),
    (lambda p: hand_made(p, kv("a.b", T.STRING, struct.pack("<Q", 1 << 62))),
     f"'a.b': a string of {1 << 62} bytes; at most {MAX_STRING_BYTES}"),
    (lambda p: hand_made(p, kv("a.b", T.STRING, s("x" * 10))[:-4]), "'a.b': needs 10 bytes at byte .* truncated"),
    (lambda p: hand_made(p, s("k" * 5000) + struct.pack("<IB", T.UINT8, 1)), "key #0: a string of 5000 bytes"),
    (lambda p: hand_made(p, kv("a.b", T.STRING, s(b"\xff\xfe"))), "'a.b': a string that is not UTF-8"),
    (lambda p: hand_made(p, kv("a.b", 13, b"")), "'a.b': value type 13 is not a GGUF type"),
    (lambda p: hand_made(p, kv("a.b", T.UINT8, b"\1"), kv("a.b", T.UINT8, b"\2")), "'a.b': appears twice"),
    (lambda p: hand_made(p, kv("GGUF.kv_count", T.UINT8, b"\1")), "'GGUF.kv_count': appears twice"),
    (lambda p: hand_made(p, kv("a.b", T.ARRAY, struct.pack("<IQ", T.ARRAY, 1) + struct.pack("<IQ", T.ARRAY, 1)
                               + struct.pack("<IQ", T.UINT8, 0))), f"'a.b': arrays nested more than {MAX_ARRAY_DEPTH}"),
    (lambda p: hand_made(p, *(kv(k, T.ARRAY, struct.pack("<IQ", T.UINT8, n) + bytes(n))
                              for k, n in (("a", MAX_ARRAY_ITEMS), ("b", MAX_ARRAY_ITEMS), ("c", 1)))),
     f"'c': its array brings the file's array items to {MAX_TOTAL_ITEMS + 1}; at most {MAX_TOTAL_ITEMS}"),
    (lambda p: hand_made(p, kv("general.alignment", T.UINT32, struct.pack("<I", 3))),
     "'general.alignment': must be a UINT32 power of two"),
    (lambda p: p.write_bytes(b"GGUF" + struct.pack("<IQQ", 7, 0, 0)), "version 7"),
    (lambda p: p.write_bytes(b"GGML" + bytes(40)), "does not start with the GGUF magic"),
])
def test_a_hostile_header_is_refused_naming_what_is_wrong(tmp_path: Path, build, match) -> None:
    path = tmp_path / "x.gguf"
    build(path)
    refused(path, match)


def tensor_info(name: str, dims: list[int], kind: int, offset: int) -> bytes:
    return s(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", kind,
                                                                                                      offset)


@pytest.mark.parametrize(("info", "match"), [
    (tensor_info("w", [4, 4], 0, 0), "tensor 'w': its data ends at byte 160, past the file's end at 105"),
    (tensor_info("w", [4, 0], 0, 0), r"tensor 'w': shape \[4, 0\]"),
    (tensor_info("w", [31], 2, 0), r"tensor 'w': shape \[31\] is not whole Q4_0 blocks of 32"),
    (tensor_info("w", [1] * 5, 0, 0), "tensor 'w': 5 dimensions"),
    (tensor_info("w", [4], 999, 0), "tensor 'w': quantization type 999"),
    (tensor_info("w", [4], 0, 3), "tensor 'w': data offset 3 is not a multiple of the alignment 32"),
    (tensor_info("w", [1 << 62, 1 << 62], 0, 0), "tensor 'w': its data ends at byte"),
])
def test_a_hostile_tensor_info_is_refused_naming_the_tensor(tmp_path: Path, info: bytes, match: str) -> None:
    refused(hand_made(tmp_path / "x.gguf", tensors=1, tail=info + bytes(40)), match)


def test_two_tensors_of_one_name_are_refused(tmp_path: Path) -> None:
    info = tensor_info("w", [4], 0, 0)
    refused(hand_made(tmp_path / "x.gguf", tensors=2, tail=info + info + bytes(64)), "tensor 'w': appears twice")


def test_a_file_cut_anywhere_is_a_gguf_error(tmp_path: Path) -> None:
    whole = tiny_llama(tmp_path / "whole.gguf").read_bytes()
    (tmp_path / "whole.gguf").unlink()
    cuts = sorted({*range(0, 400, 7), *range(400, len(whole), max(1, len(whole) // 60))})
    for cut in cuts:
        path = tmp_path / "cut.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(GGUFError, match="truncated|not a readable GGUF|tensor|missing"):
            convert_atomically(path, tmp_path / "out")
        assert not (tmp_path / "out").exists(), cut
        path.unlink()


def test_a_flipped_byte_anywhere_converts_or_is_a_gguf_error(tmp_path: Path) -> None:
    """Whatever a corrupted file holds, the conversion ends in a checkpoint or a GGUFError."""
    whole = tiny_llama(tmp_path / "whole.gguf").read_bytes()
    rng = random.Random(7)
    errors = 0
    for trial in range(150):
        data = bytearray(whole)
        at = rng.randrange(800) if trial % 3 else rng.randrange(len(data))  # mostly in the header
        data[at] ^= 1 << rng.randrange(8)
        path = tmp_path / f"flip{trial}.gguf"
        path.write_bytes(bytes(data))
        try:
            convert_atomically(path, tmp_path / f"out{trial}")
        except GGUFError:
            errors += 1
    assert errors > 10  # the flips did reach checked fields


def test_the_bounds_admit_a_real_vocabulary_size(tmp_path: Path) -> None:
    """Qwen's 151,936 token strings and 151,387 merges, as arrays of those sizes, pass the scan."""
    tokens = b"".join(s(f"t{i}") for i in range(151_936))
    merges = b"".join(s(f"t{i} t{i + 1}") for i in range(151_387))
    path = hand_made(tmp_path / "v.gguf",
                     kv("tokenizer.ggml.tokens", T.ARRAY, struct.pack("<IQ", T.STRING, 151_936) + tokens),
                     kv("tokenizer.ggml.token_type", T.ARRAY, struct.pack("<IQ", T.INT32, 151_936)
                        + bytes(4 * 151_936)),
                     kv("tokenizer.ggml.merges", T.ARRAY, struct.pack("<IQ", T.STRING, 151_387) + merges))
    check_header(path)  # no exception


def test_gguf_quantization_bounds_its_source_file_too(tmp_path: Path) -> None:
    """--quantization gguf reads the converted checkpoint's source again, at every load."""
    from types import SimpleNamespace

    from engine.quant.gguf_blocks import install_gguf_blocks

    path = hand_made(tmp_path / "big.gguf", kv("junk.bytes", T.ARRAY, struct.pack("<IQ", T.UINT8, 1_000_000)
                                               + bytes(1_000_000)))
    with pytest.raises(GGUFError, match="'junk.bytes': an array of 1000000 items"):
        install_gguf_blocks(SimpleNamespace(config=None), str(path), "llama")
