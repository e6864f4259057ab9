"""Strings a client sends that are not valid Unicode text (a lone UTF-16 surrogate, which a
Python str can hold but UTF-8 cannot encode): the engine refuses them at submission naming the
field, and its block hashes take any string, so one that slips past cannot fail a step."""
from __future__ import annotations

import hashlib

import pytest
from helpers import assert_pool_clean, greedy, make_engine, run_all

import engine.llm_engine as llm_engine
from engine import InvalidRequest, SamplingParams
from engine.block_hash import block_hash, chain_hashes, salted_root

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LONG = list(range(1, 42))  # 10 full KV blocks of 4


def test_block_hashing_takes_any_string() -> None:
    lone = [salted_root("\ud800"), salted_root("\ud801"), salted_root("\udc80"), salted_root("\ud83d\ude00")]
    assert len(set(lone)) == 4  # distinct strings, distinct roots
    assert salted_root("\ud83d\ude00") != salted_root("\U0001f600")  # the pair of surrogates is not the emoji
    for text in ("acme", "é", "\U0001f600", "租户"):  # valid text: the bytes are its UTF-8, as ever
        assert salted_root(text) == hashlib.sha256(b"brigade-salt-v1" + text.encode("utf-8")).digest()
    assert block_hash(bytes(32), [1, 2], "m\ud800") != block_hash(bytes(32), [1, 2], "m\ud801")
    assert len(chain_hashes(LONG, 4, "tiny", parent=salted_root("\ud800"))) == 10


@pytest.mark.parametrize("checked", [False, True])
@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(cache_salt="\ud800"), "cache_salt"),
    (dict(cache_salt="tenant-\udfff"), "cache_salt"),
    (dict(cache_salt=7), "cache_salt"),
    (dict(params=SamplingParams(max_tokens=4, stop=["ok", "\ud800"])), "stop"),
    (dict(prompt="hello \udc80 world"), "prompt"),
])
def test_text_that_is_not_unicode_is_refused_at_submission(kwargs, field, checked) -> None:
    engine = make_engine("tiny", num_blocks=64)
    request = {"prompt": LONG, "params": greedy(4)} | kwargs
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", request.pop("prompt"), request.pop("params"), checked=checked, **request)
    assert err.value.field == field
    assert ("must be a string" if kwargs.get("cache_salt") == 7 else "send UTF-8 text") in str(err.value)
    assert not engine.has_unfinished() and "bad" not in engine.seqs
    engine.add_request("ok", LONG, greedy(4))
    assert run_all(engine)["ok"].finish_reason == "length"
    assert_pool_clean(engine)


def test_the_engines_validate_refuses_a_stop_string_that_is_not_unicode() -> None:
    engine = make_engine("tiny", num_blocks=64)
    with pytest.raises(InvalidRequest) as err:
        engine.validate(LONG, SamplingParams(stop=["\ud800"]))
    assert err.value.field == "stop"


def test_a_surrogate_salt_that_slips_past_the_checks_still_runs(monkeypatch) -> None:
    """With the submission check gone (a path that skips it), the salt reaches the step's block
    hashes, which take any string: the request runs, alone in its chain, and so do the others."""
    monkeypatch.setattr(llm_engine, "check_strings", lambda *args: None)
    engine = make_engine("tiny", num_blocks=64)
    engine.add_request("salted", LONG, greedy(8), cache_salt="\ud800")
    engine.add_request("plain", LONG, greedy(8))
    done = run_all(engine)
    assert done["salted"].finish_reason == done["plain"].finish_reason == "length"
    assert done["salted"].token_ids == done["plain"].token_ids
    assert engine.seqs == {} and engine.cache.match(chain_hashes(LONG, 4, engine.model_id, salted_root("\ud800")))
    assert_pool_clean(engine)
