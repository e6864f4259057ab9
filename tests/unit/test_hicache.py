"""HiCache: a long prefix served from L1, L2, L3 or recomputed gives the same greedy tokens;
warm restart; selective writes; cache events follow every tier move."""
import threading

import pytest

from engine.block_hash import chain_hashes
from tests.helpers import assert_pool_clean
from tests.hicache_helpers import BLOCK, GREEDY, plain_engine, tiered_engine, tokens

PROMPT = tokens(64, seed=1)  # 16 blocks; 15 usable as a prefix hit (the last token is computed)
FILLER = tokens(80, seed=2)  # needs more blocks than the 24-block pool keeps: evicts PROMPT from L1


def _reference() -> list[int]:
    return plain_engine().generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_same_tokens_from_device_host_disk_and_recompute(tmp_path, device):
    want = _reference()
    seen = {}
    for name, host_blocks in (("host", 64), ("disk", 2)):
        engine = tiered_engine(tmp_path / name, host_blocks=host_blocks, device=device)
        cold = engine.generate([PROMPT], GREEDY)[0]
        warm = engine.generate([PROMPT], GREEDY)[0]
        engine.generate([FILLER], GREEDY)
        engine.hicache.drain()
        assert not set(chain_hashes(PROMPT, BLOCK, engine.model_id)[2:]) & set(engine.cache.by_hash)  # left L1
        lower = engine.generate([PROMPT], GREEDY)[0]
        assert cold.usage.cached_by_tier == {} and cold.token_ids == want
        assert warm.usage.cached_by_tier == {"device": 60} and warm.token_ids == want
        assert lower.token_ids == want
        seen[name] = lower.usage.cached_by_tier
        assert sum(seen[name].values()) == lower.usage.cached_tokens == 60
        assert_pool_clean(engine)
        engine.close()
    assert seen["host"].get("host", 0) >= 40 and "disk" not in seen["host"]
    assert seen["disk"].get("disk", 0) >= 40


def test_warm_restart_serves_from_disk(tmp_path):
    want = _reference()
    first = tiered_engine(tmp_path, host_blocks=2)
    first.generate([PROMPT], GREEDY)
    first.generate([FILLER], GREEDY)
    first.close()  # finishes its disk writes
    assert (tmp_path.stat().st_mode & 0o777) == 0o700

    second = tiered_engine(tmp_path, host_blocks=2, record_events=True)
    with pytest.raises(ValueError, match="in use by another engine"):
        tiered_engine(tmp_path)
    restored = {h for e in second.take_cache_events() if e.tier == "disk" for h in e.hashes}
    assert set(chain_hashes(PROMPT, BLOCK, second.model_id)[:15]) <= restored  # re-indexed and announced
    second.add_request("aborted", PROMPT, GREEDY)
    assert set(second.hicache.staged) == set(chain_hashes(PROMPT, BLOCK, second.model_id)[:15])  # reads started
    second.abort("aborted")
    assert not second.hicache.staged  # an aborted request's reads are dropped
    out = second.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want
    assert out.usage.cached_by_tier == {"disk": 60}
    assert second.stats()["hicache"]["hit_blocks"]["disk"] == 15
    second.close()


def test_selective_writes_only_blocks_hit_often_enough(tmp_path):
    engine = tiered_engine(None, hit_threshold=1, write_policy="write_back")
    prefix = chain_hashes(PROMPT, BLOCK, engine.model_id)[:15]
    engine.generate([PROMPT], GREEDY)
    engine.generate([FILLER], GREEDY)
    assert not set(prefix) & set(engine.hicache.host.blocks)  # never hit: evicted from L1 and gone
    engine.generate([PROMPT], GREEDY)
    engine.generate([PROMPT], GREEDY)  # now hit once on the device
    engine.generate([FILLER], GREEDY)
    assert set(prefix) & set(engine.hicache.host.blocks)
    engine.close()


def test_best_effort_prefetch_with_zero_timeout_still_answers_right(tmp_path):
    want = _reference()
    engine = tiered_engine(tmp_path, host_blocks=2, prefetch_policy="best_effort", prefetch_timeout_s=0.0)
    engine.generate([PROMPT], GREEDY)
    engine.generate([FILLER], GREEDY)
    engine.hicache.drain()
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == want  # whatever arrived in time was used, the rest recomputed
    assert sum(out.usage.cached_by_tier.values()) == out.usage.cached_tokens
    assert_pool_clean(engine)
    engine.close()


def _assert_events_true_to_tiers(engine, events) -> None:
    """Replayed in order, the events never store a block twice in a tier, never remove one a
    tier lacks, never lose one in between (disk is ample), and end where the tiers are."""
    present: dict[bytes, set[str]] = {}
    for e in events:
        for h in e.hashes:
            tiers = present.setdefault(h, set())
            if e.kind == "stored":
                assert e.tier not in tiers, "stored twice in one tier"
                tiers.add(e.tier)
            else:
                assert e.tier in tiers, "removed from a tier it was not in"
                tiers.discard(e.tier)
                assert tiers, f"block {h.hex()[:8]} vanished on removal from {e.tier}"
    hc = engine.hicache
    assert {h for h, t in present.items() if "device" in t} == set(engine.cache.by_hash) - {engine.cache.root.hash}
    assert {h for h, t in present.items() if "host" in t} == set(hc.host.blocks) | set(hc.writing)
    assert {h for h, t in present.items() if "disk" in t} == set(hc.disk.index)


@pytest.mark.parametrize("host_blocks", [4, 0])  # 0: L2 holds nothing, blocks pass through its write queue
def test_events_record_each_tier_move_in_order(tmp_path, host_blocks):
    engine = tiered_engine(tmp_path, host_blocks=host_blocks, record_events=True, write_policy="write_back")
    engine.generate([PROMPT], GREEDY)
    engine.generate([FILLER], GREEDY)
    engine.generate([tokens(40, seed=3)], GREEDY)
    engine.hicache.drain()
    events = engine.take_cache_events()
    _assert_events_true_to_tiers(engine, events)
    hc = engine.hicache
    assert hc.disk.index and (hc.host.blocks or not host_blocks)  # every tier was exercised
    # write_back: a device eviction is announced as stored in host, then removed from device.
    first = chain_hashes(PROMPT, BLOCK, engine.model_id)[5]
    kinds = [(e.kind, e.tier) for e in events if first in e.hashes]
    assert kinds[:3] == [("stored", "device"), ("stored", "host"), ("removed", "device")]
    engine.close()


def test_cluster_config_gives_each_prefill_worker_its_own_disk_dir(tmp_path):
    from cluster.config import ClusterConfig, load_config, worker_config
    from engine import Role

    cfg = load_config(None, {"engine": {"cache": {"hicache": {"enabled": True, "disk_dir": str(tmp_path)}}}})
    prefill = worker_config(cfg, Role.PREFILL, "prefill-1", None)
    assert prefill.cache.hicache.disk_dir == str(tmp_path / "prefill-1") and prefill.role == Role.PREFILL
    assert worker_config(cfg, Role.MIXED, "mixed-0", None).cache.hicache.disk_dir == str(tmp_path / "mixed-0")
    decode = worker_config(cfg, Role.DECODE, "decode-0", 3)
    assert decode.cache.hicache.enabled is False and decode.num_threads == 3  # decode never matches prefixes
    assert worker_config(ClusterConfig(), Role.PREFILL, "prefill-0", None).cache.hicache.enabled is False
    assert worker_config(cfg, Role.PREFILL, "prefill-0", None, publishes_events=True).cache.record_events


def test_tiers_end_the_same_however_slow_the_disk(tmp_path):
    """A hit on a block still on its way to L3 keeps it in L2 just as a hit read back from
    disk does, so what each tier holds does not depend on how fast the disk writes."""
    def run(directory, hold_writes: bool):
        engine = tiered_engine(directory, host_blocks=4, record_events=True, write_policy="write_back")
        gate = threading.Event()
        if hold_writes:  # every L3 write waits until the prompt was served again
            disk, write = engine.hicache.disk, engine.hicache.disk.write
            disk.write = lambda h, kv: gate.wait() and write(h, kv)
        engine.generate([PROMPT], GREEDY)
        engine.generate([FILLER], GREEDY)
        if hold_writes:
            assert engine.hicache.writing and not engine.hicache.disk.index
        out = engine.generate([PROMPT], GREEDY)[0]
        gate.set()
        engine.hicache.drain()
        _assert_events_true_to_tiers(engine, engine.take_cache_events())
        hc = engine.hicache
        tiers = (set(engine.cache.by_hash), list(hc.host.blocks), set(hc.disk.index), hc.writing == {})
        engine.close()
        return out, tiers

    (out_slow, slow), (out_fast, fast) = run(tmp_path / "slow", True), run(tmp_path / "fast", False)
    assert out_slow.token_ids == out_fast.token_ids == _reference()
    assert out_slow.usage.cached_tokens == out_fast.usage.cached_tokens > 0
    assert slow == fast
    assert slow[1] and slow[2] and slow[3]  # both lower tiers hold blocks, no write left pending
