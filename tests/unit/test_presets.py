"""Built-in presets: byte-identical everywhere, loadable by transformers, clear errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engine import presets
from engine.presets import PRESETS, ModelNotFound, checkpoint_sha256, materialize, resolve_model

# Recorded once. A different value on another machine means generation is not portable;
# a deliberate change to a preset's files must bump presets.FORMAT_VERSION and these.
EXPECTED_SHA256 = {
    "tiny": "6286b7919c7fd429770862d282cfa07da7b26dfd658b3dd114ed36300ea2e22a",
    "tiny-moe": "336e8eca5209f8f4abd56888248f87a24b989dcbba0340711f67c262881f9ea0",
    "bench": "e50096c8475d210d37a45407e0676dfa1e5344306760beb17ffe00d7f7d125e1",
    "tiny-draft": "d12948f41fd15078bed3d44a4f5678d3d219ad5f82bc18f59433ab0512cd8e76",
    "bench-draft": "09f8f1102bf46e3c5d7e9812c0078695a58bb7a667b17a07a9098e868979d557",
}
TEXTS = [
    "Hello, world!",
    "def f(x):\n\treturn x  # two spaces\n\n",
    "  leading and trailing spaces  ",
    "naïve café, Grüße, 你好世界, emoji 🎉👍🏽, math ∑∫",
]


def test_every_preset_has_a_recorded_checksum() -> None:
    assert set(EXPECTED_SHA256) == set(PRESETS)


@pytest.mark.parametrize("name", sorted(EXPECTED_SHA256))
def test_preset_is_byte_identical_across_caches(name: str, tmp_path: Path) -> None:
    a = materialize(name, tmp_path / "a")
    b = materialize(name, tmp_path / "b")
    assert a == tmp_path / "a" / "presets" / f"{name}-v{presets.FORMAT_VERSION}"
    assert checkpoint_sha256(a) == checkpoint_sha256(b) == EXPECTED_SHA256[name]
    assert (a / presets.MARKER).read_text().strip() == EXPECTED_SHA256[name]
    assert sorted(p.name for p in a.iterdir()) == sorted([
        presets.MARKER, "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json",
    ])


@pytest.mark.parametrize("asset", sorted(presets.TOKENIZER_SIZES))
def test_tokenizer_facts_match_the_shipped_files(asset: str) -> None:
    tok = Tokenizer.from_file(str(presets.ASSETS / asset / "tokenizer.json"))
    assert tok.get_vocab_size() == presets.TOKENIZER_SIZES[asset]
    assert [tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [
        presets.ENDOFTEXT_ID, presets.IM_START_ID, presets.IM_END_ID,
    ]
    for spec in PRESETS.values():
        if spec.tokenizer == asset:
            assert spec.config["vocab_size"] >= tok.get_vocab_size()
            assert spec.config["vocab_size"] % 64 == 0
    for text in TEXTS:
        assert tok.decode(tok.encode(text).ids) == text


@pytest.mark.parametrize("name", ["tiny", "tiny-moe"])
def test_transformers_loads_preset_with_no_missing_keys(name: str, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    path = materialize(name, tmp_path)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert type(model).__name__ == PRESETS[name].architecture
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    config = json.loads((path / "config.json").read_text())
    ids = torch.tensor([[presets.IM_START_ID, 100, 200, 300, 400, 500]])
    with torch.no_grad():
        logits = model(ids).logits  # (1, T, V)
    assert logits.shape == (1, 6, config["vocab_size"])
    assert torch.isfinite(logits).all()
    # The init is meant to make greedy output depend on the context, not repeat a token.
    out = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    ids[0, 1] = 101
    other = model.generate(ids, max_new_tokens=8, do_sample=False)[0, 6:].tolist()
    assert len(set(out)) > 1 and out != other


def test_tokenizer_round_trips_and_applies_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = materialize("tiny", tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    for text in TEXTS:
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids[0] == presets.IM_START_ID and ids.count(presets.IM_END_ID) == 2
    assert tok.eos_token_id == json.loads((path / "config.json").read_text())["eos_token_id"]
    assert tok.pad_token_id == presets.ENDOFTEXT_ID and tok.bos_token is None


def test_resolve_model(tmp_path: Path) -> None:
    assert resolve_model("tiny", tmp_path) == materialize("tiny", tmp_path)
    checkpoint = tmp_path / "presets" / f"tiny-v{presets.FORMAT_VERSION}"
    assert resolve_model(str(checkpoint)) == checkpoint
    for bogus in ["no-such-model", str(tmp_path)]:  # tmp_path exists but has no config.json
        with pytest.raises(ModelNotFound) as err:
            resolve_model(bogus, tmp_path)
        assert all(name in str(err.value) for name in PRESETS)
        assert "config.json" in str(err.value)
    with pytest.raises(ValueError, match="unknown preset"):
        materialize("no-such-model", tmp_path)


def test_materialize_reuses_cache_and_tolerates_a_concurrent_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write = presets._write_checkpoint

    def racing_write(spec: presets.PresetSpec, out: Path) -> None:
        # Another process finishes the same preset while this one is still writing.
        monkeypatch.setattr(presets, "_write_checkpoint", write)
        materialize(spec.name, tmp_path)
        write(spec, out)

    monkeypatch.setattr(presets, "_write_checkpoint", racing_write)
    path = materialize("tiny", tmp_path)
    assert checkpoint_sha256(path) == EXPECTED_SHA256["tiny"]
    assert [p.name for p in (tmp_path / "presets").iterdir()] == [path.name]  # no temp left
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert materialize("tiny", tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not rewritten


def test_unmarked_directory_is_replaced(tmp_path: Path) -> None:
    debris = tmp_path / "presets" / f"tiny-v{presets.FORMAT_VERSION}"
    debris.mkdir(parents=True)
    (debris / "config.json").write_text("{}")
    path = materialize("tiny", tmp_path)
    assert path == debris and checkpoint_sha256(path) == EXPECTED_SHA256["tiny"]
    assert len(list((tmp_path / "presets").iterdir())) == 1
