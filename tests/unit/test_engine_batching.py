"""Continuous batching gives the same tokens however requests are batched, chunked, cached or preempted.

Reference for every comparison: the same prompt run alone (or on a big pool / with a big
token budget). Greedy unless a test is about sampling. Also checks block accounting:
whatever happens, every block is back in the pool at the end.
"""
from __future__ import annotations

import pytest
from helpers import (
    assert_pool_clean,
    generate_one_by_one,
    greedy,
    make_engine,
    make_prompts,
    run_all,
)

from engine import InvalidRequest, LLMEngine, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LENGTHS = [1, 5, 8, 13, 22, 31, 40, 57, 64, 9, 3, 18]
MAX_TOKENS = [4, 16, 9, 12, 2, 16, 7, 11, 16, 5, 13, 1]


def seeded(seed: int, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=max_tokens, ignore_eos=True)


def run_recording(engine: LLMEngine, prompts, params) -> tuple[dict, dict[str, tuple[int, int]]]:
    """Add every request at once and step; also returns each request's (first token step, finish step)."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, sp)
    done, span = {}, {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            first, _ = span.get(out.request_id, (step, 0))
            span[out.request_id] = (first, step)
            if out.finished:
                done[out.request_id] = out
    return [done[f"r{i}"] for i in range(len(prompts))], span


@pytest.fixture(scope="module")
def qwen3(hf_checkpoints):
    return hf_checkpoints.get("qwen3")


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe"])
def test_continuous_batching_equals_one_at_a_time(name, hf_checkpoints) -> None:
    path = hf_checkpoints.get(name)
    prompts = make_prompts(LENGTHS, seed=2)
    params = [greedy(n) for n in MAX_TOKENS]
    want = generate_one_by_one(make_engine(path, prefix_cache=False), prompts, params)

    engine = make_engine(path, budget=16, max_num_seqs=4)
    outs, span = run_recording(engine, prompts, params)

    assert [o.token_ids for o in outs] == want
    assert [len(o.token_ids) for o in outs] == MAX_TOKENS
    assert all(o.finish_reason == "length" for o in outs)
    # Requests really interleaved: some ran concurrently, and some joined after others left.
    assert any(a[0] < b[0] <= a[1] for a in span.values() for b in span.values())
    assert any(a[1] < b[0] for a in span.values() for b in span.values())
    assert_pool_clean(engine)


def test_chunked_prefill_equals_unchunked(qwen3) -> None:
    prompts = make_prompts([100, 47, 16, 17, 3, 64], seed=3)
    params = greedy(10)
    want = [o.token_ids for o in make_engine(qwen3, budget=2048).generate(prompts, params)]

    engine = make_engine(qwen3, budget=16, block_size=4)
    outs, span = run_recording(engine, prompts, [params] * len(prompts))
    assert [o.token_ids for o in outs] == want
    assert span["r0"][0] >= 100 // 16 + 1  # the 100-token prompt took 7 chunks before its first token
    assert_pool_clean(engine)


def test_prefix_cache_hits_report_cached_tokens_and_keep_tokens(qwen3) -> None:
    bs = 4
    prefix = make_prompts([40], seed=4)[0]
    a = prefix + [7, 8, 9, 10, 11, 12, 13]  # 47 tokens
    b = prefix + [20, 21, 22]  # 43 tokens, diverges right after the 10 prefix blocks
    c = make_prompts([48], seed=5)[0]  # a whole number of blocks
    params = greedy(8)
    ref = make_engine(qwen3, prefix_cache=False)
    want = {name: ref.generate([p], params)[0].token_ids for name, p in [("a", a), ("b", b), ("c", c)]}

    engine = make_engine(qwen3, block_size=bs)
    first_a, first_c = engine.generate([a, c], params)
    assert (first_a.usage.cached_tokens, first_c.usage.cached_tokens) == (0, 0)
    again_a, again_c, then_b = engine.generate([a, c, b], params)
    # Whole prompt seen before: every full block except the one holding the last token.
    assert again_a.usage.cached_tokens == ((47 - 1) // bs) * bs == 44
    assert again_c.usage.cached_tokens == ((48 - 1) // bs) * bs == 44
    assert then_b.usage.cached_tokens == 40  # the shared prefix only
    assert [first_a.token_ids, again_a.token_ids, then_b.token_ids] == [want["a"], want["a"], want["b"]]
    assert [first_c.token_ids, again_c.token_ids] == [want["c"], want["c"]]
    assert again_a.usage.prompt_tokens == 47 and again_a.usage.completion_tokens == 8
    assert engine.stats()["prefix_hit_rate"] > 0
    assert_pool_clean(engine)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_gives_the_same_tokens_as_a_big_pool(qwen3, prefix_cache) -> None:
    prompts = make_prompts([10, 30, 21, 14, 26, 7], seed=6)
    params = [greedy(16), greedy(16), seeded(1, 16), greedy(12), seeded(2, 16), greedy(16)]
    want = [o.token_ids for o in make_engine(qwen3, num_blocks=256).generate(prompts, params)]

    engine = make_engine(qwen3, num_blocks=14, block_size=4, prefix_cache=prefix_cache)
    got = [o.token_ids for o in engine.generate(prompts, params)]
    assert engine.stats()["preemptions"] > 0
    assert got == want
    assert_pool_clean(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(qwen3) -> None:
    prompts = make_prompts([12, 33, 5], seed=7)
    params = [seeded(11), seeded(12), seeded(13)]
    alone = generate_one_by_one(make_engine(qwen3), prompts, params)

    # Mixed with greedy and unseeded requests, in another order, on an engine with another seed.
    others = make_prompts([20, 9, 41], seed=8)
    engine = make_engine(qwen3, budget=16, seed=5)
    mixed = engine.generate([others[0], prompts[2], others[1], prompts[0], others[2], prompts[1]],
                            [greedy(12), params[2], SamplingParams(max_tokens=12, ignore_eos=True),
                             params[0], SamplingParams(temperature=1.3, max_tokens=5), params[1]])
    assert [mixed[3].token_ids, mixed[5].token_ids, mixed[1].token_ids] == alone
    assert engine.generate(prompts, params)[0].token_ids == alone[0]  # and again, same engine
    # It is really sampling: not the greedy tokens, and the seed matters.
    greedy_tokens = make_engine(qwen3).generate(prompts, greedy(12))
    assert all(g.token_ids != s for g, s in zip(greedy_tokens, alone))
    assert make_engine(qwen3).generate([prompts[0]], seeded(99))[0].token_ids != alone[0]


def test_unseeded_sampling_follows_the_engine_seed(qwen3) -> None:
    prompts = make_prompts([12, 30], seed=9)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    run = lambda seed: [o.token_ids for o in make_engine(qwen3, seed=seed).generate(prompts, params)]
    first = run(0)
    assert run(0) == first
    assert run(1) != first


# -- pool accounting -----------------------------------------------------------------


def test_abort_mid_run_frees_every_block(qwen3) -> None:
    engine = make_engine(qwen3, budget=16, max_num_seqs=3, num_blocks=64)
    prompts = make_prompts([30, 6, 50, 12, 9, 25], seed=10)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(16))
    for _ in range(4):
        engine.step()
    # r0 is decoding, r2 is mid-prefill (50 tokens at 16 per step), r5 is still waiting.
    assert engine.seqs["r0"].num_computed > 30 and len(engine.seqs["r0"].output_token_ids) > 0
    assert 0 < engine.seqs["r2"].num_computed < 50
    assert engine.seqs["r5"].num_computed == 0 and not engine.seqs["r5"].block_table
    for rid in ("r0", "r2", "r5"):
        out = engine.abort(rid)
        assert out.finished and out.finish_reason == "abort"
    assert engine.abort("r0") is None and engine.abort("unknown") is None
    done = run_all(engine)
    assert sorted(done) == ["r1", "r3", "r4"]
    assert all(len(o.token_ids) == 16 for o in done.values())
    assert_pool_clean(engine)


def test_abort_everything_frees_every_block(qwen3) -> None:
    engine = make_engine(qwen3, budget=16, num_blocks=64)
    for i, p in enumerate(make_prompts([30, 6, 50], seed=11)):
        engine.add_request(f"r{i}", p, greedy(16))
    engine.step()
    engine.step()
    assert engine.pool.num_referenced > 0
    for i in range(3):
        engine.abort(f"r{i}")
    assert engine.step() == []
    assert_pool_clean(engine)
    assert engine.stats()["running"] == engine.stats()["waiting"] == 0


def test_identical_prefixes_prefilled_together_keep_the_pool_consistent(qwen3) -> None:
    """Regression: a and b share two blocks and prefill in one step, so b's copies stay private.

    b's third block used to be cached as a child of a's second block; once a finished, a's
    blocks counted as evictable but could not be evicted (a child was referenced), and the
    next big allocation crashed in BlockPool.allocate (IndexError: pop from an empty deque).
    """
    engine = make_engine(qwen3, num_blocks=16, block_size=4)
    shared = list(range(10, 18))
    engine.add_request("a", shared + [30, 31, 32, 33], greedy(1))
    engine.add_request("b", shared + [40, 41, 42, 43], greedy(8))
    (a, _), _ = engine.step(), engine.step()
    assert a.request_id == "a" and a.finished
    assert engine.pool.num_free == 12  # 16 - b's 4 blocks; a's 3 cached blocks are all evictable
    engine.add_request("c", list(range(100, 144)), greedy(1))  # 11 blocks: 9 free + 2 evicted
    done = {"a": a, **run_all(engine)}
    assert sorted(done) == ["a", "b", "c"]
    ref = make_engine(qwen3, prefix_cache=False)
    assert done["b"].token_ids == ref.generate([shared + [40, 41, 42, 43]], greedy(8))[0].token_ids
    assert_pool_clean(engine)


def test_prompt_over_the_step_budget_is_refused_without_chunked_prefill(qwen3) -> None:
    engine = make_engine(qwen3, budget=16, chunked=False)
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("a", list(range(10, 27)), greedy(4))  # 17 tokens > 16
    assert err.value.field == "prompt"
    engine.add_request("b", list(range(10, 26)), greedy(4))  # exactly the budget runs
    assert len(run_all(engine)["b"].token_ids) == 4


def test_preempted_sequence_longer_than_the_budget_resumes_without_chunked_prefill(qwen3) -> None:
    engine = make_engine(qwen3, budget=16, chunked=False, num_blocks=10, prefix_cache=False)
    for i in range(2):
        engine.add_request(f"r{i}", list(range(10 + i, 22 + i)), greedy(16))  # 28 tokens = 7 blocks each
    done = run_all(engine, max_steps=200)  # r1 is preempted at 20 tokens and then never fits a step
    assert engine.stats()["preemptions"] > 0
    assert sorted(done) == ["r0", "r1"]
