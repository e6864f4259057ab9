"""HiCache under a random shared-prefix workload: no tier over its budget at any step, no KV
block leaked at the end, the disk index true to the directory, and the same greedy tokens as
an engine that recomputes everything."""
import random

import pytest
import torch

from engine import SamplingParams
from engine.hicache import DiskStore, HostPool
from engine.hicache.tier_manager import WRITE_QUEUE_BLOCKS
from tests.helpers import assert_pool_clean
from tests.hicache_helpers import plain_engine, tiered_engine, tokens


def _workload(seed: int):
    rng = random.Random(seed)
    bases = [tokens(rng.randrange(8, 40), seed=seed * 100 + i) for i in range(4)]
    prompts = [bases[rng.randrange(4)] + tokens(rng.randrange(1, 24), seed=seed * 1000 + i) for i in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randrange(1, 6), ignore_eos=True) for _ in prompts]
    return rng, prompts, params


@pytest.mark.parametrize("policy,threshold", [("write_through", 0), ("write_back", 0), ("write_through", 1)])
def test_random_workload_respects_budgets_and_leaks_nothing(tmp_path, policy, threshold):
    rng, prompts, params = _workload(seed=len(policy) + threshold)
    want = [o.token_ids for o in plain_engine(num_blocks=256).generate(prompts, params)]
    engine = tiered_engine(tmp_path, num_blocks=20, host_blocks=6, disk_blocks=12, write_policy=policy,
                           hit_threshold=threshold, budget=64)
    hc = engine.hicache
    got: dict[str, list[int]] = {}
    queued = 0
    while queued < len(prompts) or engine.has_unfinished():
        for _ in range(min(rng.randrange(0, 3), len(prompts) - queued)):
            engine.add_request(f"r{queued}", prompts[queued], params[queued])
            queued += 1
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
        assert hc.host.used_bytes <= hc.host.budget
        assert hc.host.used_bytes == sum(t.numel() * t.element_size() for t in hc.host.blocks.values())
        assert hc.disk.used_bytes <= hc.disk.budget
        assert len(hc.writing) <= WRITE_QUEUE_BLOCKS
    hc.drain()
    assert [got[f"r{i}"] for i in range(len(prompts))] == want
    assert_pool_clean(engine)
    files = {p.name: p.stat().st_size for p in tmp_path.glob("*.kv")}
    assert files == {f"{h.hex()}.kv": size for h, size in hc.disk.index.items()}
    assert sum(files.values()) == hc.disk.used_bytes <= hc.disk.budget
    stats = engine.stats()["hicache"]
    assert stats["hit_blocks"]["host"] + stats["hit_blocks"]["disk"] > 0  # the lower tiers served hits
    assert stats["disk"]["evicted"] > 0  # and the disk budget made it evict
    engine.close()


def test_host_and_disk_evict_least_recently_used_first(tmp_path):
    kv = torch.zeros(2, 2, 4, 2, 32)
    size = kv.numel() * 4
    host = HostPool(2 * size)
    assert host.put(b"a", kv) == (True, []) and host.put(b"b", kv) == (True, [])
    host.get(b"a")  # now b is the least recently used
    stored, evicted = host.put(b"c", kv)
    assert stored and [h for h, _ in evicted] == [b"b"]
    assert list(host.blocks) == [b"a", b"c"]

    layout = {"dtype": "float32", "block_shape": list(kv.shape)}
    names = [bytes([i]) * 32 for i in range(3)]
    disk = DiskStore(tmp_path, 1, "tiny", layout, torch.float32, tuple(kv.shape))
    assert disk.write(names[0], kv) is False  # one file is over this budget: refused, nothing written
    disk.close()
    disk = DiskStore(tmp_path, 10**9, "tiny", layout, torch.float32, tuple(kv.shape))
    assert disk.write(names[0], kv)
    file_size = disk.used_bytes
    disk.budget = 2 * file_size
    assert disk.write(names[1], kv)
    assert disk.read(names[0]) is not None  # names[1] is now the least recently used
    assert disk.write(names[2], kv)
    assert list(disk.index) == [names[0], names[2]]
    assert disk.take_changes() == [("stored", names[0]), ("stored", names[1]), ("removed", names[1]),
                                   ("stored", names[2])]
    assert sorted(p.name for p in tmp_path.glob("*.kv")) == sorted(f"{h.hex()}.kv" for h in disk.index)
