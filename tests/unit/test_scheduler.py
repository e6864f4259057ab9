"""BlockPool + RadixCache with exact block ids; stop conditions and request validation in the engine."""
from __future__ import annotations

import json
import shutil

import pytest
from helpers import assert_pool_clean, greedy, make_engine, make_prompts

from engine import InvalidRequest, SamplingParams
from engine.block_hash import ROOT, chain_hashes
from engine.block_pool import BlockPool, NoFreeBlocks
from engine.config import SchedulerConfig
from engine.radix_cache import RadixCache
from engine.scheduler import Scheduler
from engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def make_cache(num_blocks: int) -> tuple[BlockPool, RadixCache]:
    pool = BlockPool(num_blocks)
    return pool, RadixCache(pool)


def names(*tokens: int) -> list[bytes]:
    """Chained hashes with one token per block, so a path reads as its tokens."""
    return chain_hashes(list(tokens), 1, "m")


def insert_chain(cache: RadixCache, hashes: list[bytes], blocks: list[int], parent: bytes = ROOT) -> None:
    for h, b in zip(hashes, blocks):
        assert cache.insert(parent, h, b)
        parent = h


# -- BlockPool -------------------------------------------------------------------------


def test_pool_allocates_in_order_and_reuses_released_blocks_last() -> None:
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert (pool.num_free, pool.num_referenced) == (2, 2)
    pool.release([0])
    assert pool.allocate(3) == [2, 3, 0]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.release([1, 2, 3, 0])
    assert (pool.num_free, pool.num_referenced) == (4, 0)
    with pytest.raises(AssertionError):
        pool.release([1])


# -- RadixCache ------------------------------------------------------------------------


def test_match_returns_the_longest_cached_prefix_without_taking_references() -> None:
    pool, cache = make_cache(8)
    a = names(1, 2, 3)
    insert_chain(cache, a, pool.allocate(3))  # blocks 0, 1, 2
    b = names(1, 2, 9, 9)
    insert_chain(cache, b[2:], pool.allocate(2), parent=b[1])  # blocks 3, 4 under block 1
    assert cache.match(a) == [0, 1, 2]
    assert cache.match(a + names(1, 2, 3, 4)[3:]) == [0, 1, 2]
    assert cache.match(b) == [0, 1, 3, 4]
    assert cache.match(names(1, 2, 7)) == [0, 1]
    assert cache.match(names(2, 2, 3)) == []
    assert cache.match([]) == []
    assert pool.ref_counts[:5] == [1, 1, 1, 1, 1]  # untouched
    assert not cache.insert(a[0], a[1], 7)  # hash already cached: the caller keeps block 7 private
    assert not cache.insert(names(5)[0], names(5, 6)[1], 7)  # unknown parent
    assert len(cache) == 5


def test_eviction_takes_leaves_least_recently_used_first() -> None:
    pool, cache = make_cache(6)
    a = names(1, 2, 3)
    insert_chain(cache, a, pool.allocate(3))  # 0 -> 1 -> 2
    b = names(1, 5)
    hit = cache.match(b[:1])
    assert hit == [0]
    pool.ref(hit)
    insert_chain(cache, b[1:], pool.allocate(1), parent=b[0])  # 0 -> 3, newer than 2
    pool.release([0, 1, 2])
    pool.release([0, 3])
    assert (pool.num_free, pool.num_referenced, len(cache)) == (6, 0, 4)

    # Free blocks 4, 5 go first; then leaf 2 (older than leaf 3); then 1, a leaf now;
    # then 3; the root's child 0 only when it has no children left.
    assert pool.allocate(3) == [4, 5, 2]
    assert pool.allocate(1) == [1]
    assert cache.match(a) == [0]
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) == [0]
    assert len(cache) == 0 and cache.stats.evicted_blocks == 4
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)


def test_a_match_refreshes_recency() -> None:
    for touched, evicted_first in [(None, 0), (0, 1), (1, 0)]:
        pool, cache = make_cache(2)
        x, y = names(1), names(2)
        insert_chain(cache, x, [pool.allocate(1)[0]])  # block 0
        insert_chain(cache, y, [pool.allocate(1)[0]])  # block 1, newer
        pool.release([0, 1])
        if touched is not None:
            cache.match([x, y][touched])
        assert pool.allocate(1) == [evicted_first]


def test_referenced_blocks_are_never_evicted() -> None:
    pool, cache = make_cache(4)
    a = names(1, 2, 3)
    insert_chain(cache, a, pool.allocate(3))  # 0 -> 1 -> 2
    pool.release([2])  # only the leaf is unreferenced
    assert pool.num_free == 2
    assert pool.allocate(2) == [3, 2]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    assert cache.match(a) == [0, 1]
    # A cache hit takes a reference on an evictable block: it is protected again.
    pool.release([3, 2, 1, 0])
    hit = cache.match(a)
    pool.ref(hit)
    assert hit == [0, 1] and pool.num_free == 2
    assert sorted(pool.allocate(2)) == [2, 3]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.release(hit)
    assert pool.allocate(1) == [1]


def test_register_blocks_extends_only_the_sequences_own_cached_chain() -> None:
    """b's first two blocks duplicate a's (both computed before either was cached), so b's copies
    stay private, and so must its third block: under a's copy it would pin a's blocks."""
    pool, cache = make_cache(6)
    sched = Scheduler(SchedulerConfig(), pool, cache, block_size=2, model_id="m")
    a = Sequence("a", [1, 2, 3, 4, 5, 6], SamplingParams(), 0, block_table=pool.allocate(3), num_computed=6)
    b = Sequence("b", [1, 2, 3, 4, 7, 8], SamplingParams(), 1, block_table=pool.allocate(3), num_computed=6)
    sched.register_blocks(a)
    sched.register_blocks(b)
    assert sorted(cache.by_block) == [0, 1, 2]
    assert cache.match(b.block_hashes) == [0, 1]
    assert (a.num_registered_blocks, b.num_registered_blocks) == (3, 3)
    pool.release(a.block_table)
    assert pool.num_free == 3
    assert pool.allocate(3) == [2, 1, 0]  # every block counted as evictable really is
    pool.release(b.block_table)
    assert pool.num_free == 3


# -- stop conditions -----------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3(hf_checkpoints):
    return hf_checkpoints.get("qwen3")


def test_max_tokens_finishes_with_length(qwen3) -> None:
    engine = make_engine(qwen3)
    outs = engine.generate(make_prompts([5, 9], seed=30), [greedy(1), greedy(7)])
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(1, "length"), (7, "length")]
    assert [o.usage.completion_tokens for o in outs] == [1, 7]


def test_stop_token_ids_and_eos(qwen3, tmp_path) -> None:
    prompt = make_prompts([11], seed=31)[0]
    full = make_engine(qwen3).generate([prompt], greedy(16))[0].token_ids
    k = next(i for i in range(3, 16) if full[i] not in full[:i])  # first time this token shows up
    stop_id = full[k]

    out = make_engine(qwen3).generate([prompt], greedy(16, stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full[: k + 1] and out.finish_reason == "stop"  # the stop token is returned

    # The same token as the checkpoint's EOS: stops by default, not with ignore_eos.
    eos_dir = tmp_path / "qwen3-eos"
    shutil.copytree(qwen3, eos_dir)
    config = json.loads((eos_dir / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": stop_id}))
    engine = make_engine(eos_dir)
    stopped, ignored = engine.generate([prompt, prompt], [SamplingParams(temperature=0, max_tokens=16),
                                                          greedy(16)])
    assert stopped.token_ids == full[: k + 1] and stopped.finish_reason == "stop"
    assert ignored.token_ids == full and ignored.finish_reason == "length"
    assert_pool_clean(engine)


def test_stop_string_is_cut_from_the_text() -> None:
    engine = make_engine("tiny", block_size=16)
    prompt = "def f(x):"
    ref = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    text = ref.text
    # A 3-character ASCII piece from the middle that first occurs there (it may span tokens).
    i = next(i for i in range(len(text) // 3, len(text) - 3)
             if text[i:i + 3].isascii() and text[i:i + 3].isprintable() and text.find(text[i:i + 3]) == i)
    stop = text[i:i + 3]

    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                   stop=("never-in-this-text", stop)))[0]
    assert out.finish_reason == "stop"
    assert out.text == text[:i]
    n = len(out.token_ids)
    assert out.token_ids == ref.token_ids[:n] and n < len(ref.token_ids)
    # It stopped on the token that completed the stop string, not later.
    assert stop in engine.tokenizer.decode(out.token_ids) and stop not in engine.tokenizer.decode(out.token_ids[:-1])
    assert_pool_clean(engine)


# -- request validation --------------------------------------------------------------


@pytest.mark.parametrize("prompt, params, field", [
    ([], greedy(4), "prompt"),
    ([5, 512], greedy(4), "prompt"),  # vocab is 512
    ([5, -1], greedy(4), "prompt"),
    (list(range(64)), greedy(1), "prompt"),  # the whole context, no room for output
    (list(range(100)), greedy(1), "prompt"),
    (list(range(60)), greedy(5), "max_tokens"),  # 60 + 5 > 64
    (list(range(3)), greedy(62), "max_tokens"),
])
def test_add_request_validation_names_the_field(qwen3, prompt, params, field) -> None:
    engine = make_engine(qwen3, max_model_len=64)
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("r", prompt, params)
    assert err.value.field == field
    assert_pool_clean(engine)
    assert engine.seqs == {}


def test_add_request_validation_edges(qwen3) -> None:
    engine = make_engine(qwen3, max_model_len=64, num_blocks=8, block_size=4)
    engine.add_request("fits", list(range(28)), greedy(4))  # 32 tokens: all 8 blocks, within context
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("too-many-blocks", list(range(28)), greedy(5))  # 33 tokens: 9 blocks
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("fits", [1, 2], greedy(1))
    assert err.value.field == "request_id"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("text", "no tokenizer here", greedy(1))
    assert err.value.field == "prompt"
    assert list(engine.seqs) == ["fits"]


def test_add_request_validation_of_text_prompts() -> None:
    engine = make_engine("tiny")
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("r", "", greedy(1))
    assert err.value.field == "prompt"
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("r", "hi", greedy(5000))  # the preset's context is 4096
    assert err.value.field == "max_tokens"
