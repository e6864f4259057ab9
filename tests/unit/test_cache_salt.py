"""Cache salt: a salted request's hash chain starts from its own root, so tenants share no blocks."""
import hashlib

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.block_hash import ROOT, chain_hashes, salted_root

PROMPT = list(range(1, 42))  # 10 full blocks of 4, and a last token the engine always recomputes


def make_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                  cache=CacheConfig(block_size=4, num_blocks=64, record_events=True)))


def cached(engine: LLMEngine, rid: str, salt: str | None) -> int:
    engine.add_request(rid, PROMPT, SamplingParams(max_tokens=1), cache_salt=salt)
    while True:
        for out in engine.step():
            if out.finished:
                return out.usage.cached_tokens


def test_salted_root_definition():
    assert salted_root(None) == salted_root("") == ROOT
    assert salted_root("acme") == hashlib.sha256(b"brigade-salt-v1" + b"acme").digest()
    assert salted_root("acme").hex() == "a901b3a4bd0f484a0d8104acdbeeae009c1d83c0f2dbaadd94cb984545481549"
    assert salted_root("acme") != salted_root("acme2")


def test_salts_never_share_blocks_and_events_name_salted_hashes():
    engine = make_engine()
    assert cached(engine, "a1", "acme") == 0
    assert cached(engine, "b1", "globex") == 0  # same tokens, other tenant: a miss
    assert cached(engine, "n1", None) == 0  # unsalted: a miss too
    assert cached(engine, "a2", "acme") == 40  # same tenant: every full block but the last token's
    stored = [h for e in engine.take_cache_events() if e.kind == "stored" for h in e.hashes]
    salted = chain_hashes(PROMPT, 4, engine.model_id, parent=salted_root("acme"))
    assert stored[:10] == salted
    assert set(chain_hashes(PROMPT, 4, engine.model_id)) <= set(stored)
    assert not set(salted) & set(chain_hashes(PROMPT, 4, engine.model_id, parent=salted_root("globex")))


def test_salted_tokens_equal_unsalted():
    engine = make_engine()
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for rid, salt in [("x", None), ("y", "acme"), ("z", "acme")]:
        engine.add_request(rid, PROMPT, greedy, cache_salt=salt)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    outs[rid] = out
    assert outs["x"].token_ids == outs["y"].token_ids == outs["z"].token_ids
    assert outs["z"].usage.cached_tokens == 40
