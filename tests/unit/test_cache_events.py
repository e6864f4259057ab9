"""The engine's cache events: every named block stored, every evicted one removed, in order."""
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.block_hash import chain_hashes


def test_events_follow_inserts_and_evictions():
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32",
                                    cache=CacheConfig(block_size=4, num_blocks=8, record_events=True)))
    greedy = SamplingParams(max_tokens=1)
    first = list(range(1, 14))  # 3 full blocks
    engine.generate([first], greedy)
    events = engine.take_cache_events()
    stored = [h for e in events if e.kind == "stored" for h in e.hashes]
    assert {e.tier for e in events} == {"device"}
    assert stored[:3] == chain_hashes(first, 4, engine.model_id)  # prefix blocks in order, parents first
    assert engine.take_cache_events() == []  # taken once

    engine.generate([list(range(100, 129))], greedy)  # 7+ blocks: the pool must evict the first prompt's
    events = engine.take_cache_events()
    removed = {h for e in events if e.kind == "removed" for h in e.hashes}
    assert removed & set(chain_hashes(first, 4, engine.model_id))
    live = set(engine.cache.by_hash) - {engine.cache.root.hash}
    seen = set(stored)
    for e in events:  # replaying every event reproduces the cache's contents
        seen = seen | set(e.hashes) if e.kind == "stored" else seen - set(e.hashes)
    assert seen == live


def test_events_off_by_default():
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", cache=CacheConfig(block_size=4, num_blocks=8)))
    engine.generate([list(range(1, 14))], SamplingParams(max_tokens=1))
    assert engine.take_cache_events() == []
