"""Disaggregation in one process: a prefill-role engine exports KV, a decode-role engine imports it.

The tokens must equal a mixed engine's (DESIGN.md: same answer colocated or disaggregated),
and neither side may leak blocks, whether requests finish, are exported or are aborted.
"""
from __future__ import annotations

import pytest
from helpers import assert_pool_clean, greedy, make_engine, make_prompts, run_all

from engine import InvalidRequest, KVExport, LLMEngine, Role, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BS = 4
LENGTHS = [1, 3, 4, 5, 8, 13, 22, 37]  # most not a multiple of the block size


@pytest.fixture(scope="module")
def qwen3(hf_checkpoints):
    return hf_checkpoints.get("qwen3")


def prefill_all(engine: LLMEngine, prompts, params: list[SamplingParams], prefix: str = "r") -> list[KVExport]:
    """Prefill every prompt; export each as soon as its first token is out. Exports in input order."""
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(f"{prefix}{i}", p, sp)
    exports = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.kv_ready and not out.finished and len(out.token_ids) == 1
            assert engine.pool.num_referenced > 0  # held for export
            exports[out.request_id] = engine.export_kv(out.request_id)
    return [exports[f"{prefix}{i}"] for i in range(len(prompts))]


def decode_all(engine: LLMEngine, exports: list[KVExport], params: list[SamplingParams]) -> list:
    for e, sp in zip(exports, params):
        engine.import_kv(e, sp)
    done = run_all(engine)
    return [done[e.request_id] for e in exports]


def test_prefill_export_then_decode_import_equals_mixed(qwen3) -> None:
    prompts = make_prompts(LENGTHS, seed=20)
    params = [greedy(10)] * 6 + [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=5, max_tokens=10, ignore_eos=True),
        greedy(3, logprobs=2),
    ]
    mixed = make_engine(qwen3, block_size=BS).generate(prompts, params)

    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL, budget=16)  # chunked prefill too
    exports = prefill_all(pre, prompts, params)
    for e, p in zip(exports, prompts):
        assert e.num_tokens == len(p) and e.prompt_token_ids == p
        assert e.kv.shape[2] == len(e.block_ids) == -(-len(p) // BS)
    assert_pool_clean(pre)  # exported blocks were released (full ones stay cached, evictable)

    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE)
    outs = decode_all(dec, exports, params)
    assert [o.token_ids for o in outs] == [m.token_ids for m in mixed]
    assert all(o.finish_reason == "length" for o in outs)
    # The first token's logprobs travel with the KV (equal up to float32 rounding: other batches).
    got, want = outs[-1].logprobs, mixed[-1].logprobs
    ids = lambda lps: [(lp.token_id, [i for i, _ in lp.top]) for lp in lps]
    assert ids(got) == ids(want)
    assert [v for lp in got for _, v in lp.top] == pytest.approx([v for lp in want for _, v in lp.top], abs=1e-4)
    assert_pool_clean(dec)


def test_prefill_side_prefix_hit_carries_cached_tokens(qwen3) -> None:
    shared = make_prompts([21], seed=21)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10]  # 24 and 23 tokens; 5 shared full blocks
    params = [greedy(8)]
    mixed = make_engine(qwen3, block_size=BS, prefix_cache=False).generate([first, second], greedy(8))

    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE)
    [e1] = prefill_all(pre, [first], params, prefix="a")
    [e2] = prefill_all(pre, [second], params, prefix="b")
    assert (e1.cached_tokens, e2.cached_tokens) == (0, 20)
    [o1] = decode_all(dec, [e1], params)
    [o2] = decode_all(dec, [e2], params)
    assert [o1.token_ids, o2.token_ids] == [m.token_ids for m in mixed]
    assert (o1.usage.cached_tokens, o2.usage.cached_tokens) == (0, 20)
    assert_pool_clean(pre)
    assert_pool_clean(dec)


def test_decode_side_imports_sharing_a_prefix_keep_the_pool_consistent(qwen3) -> None:
    """Regression: y's copy of the shared blocks stays private on the decode side (x cached them
    first); y's next block used to be cached under x's copy, so after x finished the pool
    counted unevictable blocks as free and the next reserve() crashed."""
    shared = list(range(50, 58))
    prompts = [shared + [1, 2, 3, 4], shared + [9, 8, 7, 6], list(range(100, 144))]
    params = [greedy(2), greedy(8), greedy(2)]
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL, prefix_cache=False)
    ex, ey, ez = prefill_all(pre, prompts, params)

    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE, num_blocks=16)
    dec.import_kv(ex, params[0])
    dec.import_kv(ey, params[1])
    (x_out,) = [o for o in dec.step() if o.finished]  # x is done, its blocks stay cached
    assert x_out.request_id == ex.request_id
    dec.import_kv(ez, params[2])  # 11 blocks: 9 on the free list and 2 evicted
    done = {x_out.request_id: x_out, **run_all(dec)}
    mixed = make_engine(qwen3, block_size=BS).generate(prompts, params)
    assert [done[e.request_id].token_ids for e in (ex, ey, ez)] == [m.token_ids for m in mixed]
    assert_pool_clean(dec)


def test_abort_on_the_prefill_side_frees_blocks(qwen3) -> None:
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL, budget=16, max_num_seqs=2)
    for i, p in enumerate(make_prompts([6, 40, 9, 12], seed=22)):
        pre.add_request(f"r{i}", p, greedy(8))
    first = pre.step()
    assert [o.request_id for o in first] == ["r0"] and first[0].kv_ready
    # r0 waits for export, r1 is mid-prefill (40 tokens at 16 a step), r2 and r3 are waiting.
    assert 0 < pre.seqs["r1"].num_computed < 40 and pre.stats()["prefilled"] == 1
    for rid in ("r0", "r1", "r2"):
        assert pre.abort(rid).finish_reason == "abort"
    with pytest.raises(KeyError):
        pre.export_kv("r0")
    outs = [o for _ in range(5) for o in pre.step()]
    assert [o.request_id for o in outs] == ["r3"]
    pre.release("r3")  # given up without exporting
    assert_pool_clean(pre)
    assert pre.stats()["prefilled"] == 0


def test_abort_on_the_decode_side_frees_blocks(qwen3) -> None:
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    prompts = make_prompts([7, 16, 11], seed=23)
    exports = prefill_all(pre, prompts, [greedy(12)] * 3)

    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE, num_blocks=32)
    reserved = dec.reserve("pending", 30)  # payload never arrives
    assert len(reserved) == 8 and dec.stats()["reserved"] == 1
    for e in exports:
        dec.import_kv(e, greedy(12))
    dec.step()
    dec.step()
    assert dec.pool.num_referenced > 8
    running = dec.abort(exports[0].request_id)
    assert running.finish_reason == "abort" and len(running.token_ids) == 3  # imported first + 2 decoded
    assert dec.abort("pending") is None  # a reservation has no output, but its blocks go back
    assert dec.stats()["reserved"] == 0
    done = run_all(dec)
    assert sorted(done) == sorted(e.request_id for e in exports[1:])
    assert all(len(o.token_ids) == 12 for o in done.values())
    assert_pool_clean(dec)


def test_decode_import_already_at_max_tokens_generates_nothing_more(qwen3) -> None:
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    [export] = prefill_all(pre, [[5, 6, 7]], [greedy(4)])
    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE)
    [out] = decode_all(dec, [export], [greedy(1)])
    assert out.token_ids == [export.first_token_id] and out.finish_reason == "length"


def test_refused_import_leaves_no_blocks_reserved(qwen3) -> None:
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    [export] = prefill_all(pre, [list(range(5, 45))], [greedy(4)])
    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE, max_model_len=64)
    with pytest.raises(InvalidRequest) as err:
        dec.import_kv(export, greedy(40))  # 40 + 40 > 64
    assert err.value.field == "max_tokens"
    assert dec.stats()["reserved"] == 0
    assert_pool_clean(dec)


def test_decode_engine_without_chunked_prefill_accepts_long_prompts(qwen3) -> None:
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    [export] = prefill_all(pre, [list(range(5, 45))], [greedy(4)])
    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE, budget=16, chunked=False)
    [out] = decode_all(dec, [export], [greedy(4)])
    assert len(out.token_ids) == 4


def test_imports_that_fill_the_pool_between_them_do_not_wait_for_each_other(qwen3) -> None:
    """Two imports each holding half the pool and each one block short of its next token: with
    nothing running to preempt, the scheduler frees the second's blocks (it recomputes) so the
    first can run; both finish with the tokens of a roomy engine, and the pool is whole."""
    prompts = make_prompts([12, 12], seed=31)  # 3 blocks each; the 13th token needs a 4th
    params = [greedy(6)] * 2
    pre = make_engine(qwen3, block_size=BS, role=Role.PREFILL)
    exports = prefill_all(pre, prompts, params)
    want = [o.token_ids for o in decode_all(make_engine(qwen3, block_size=BS, role=Role.DECODE), exports, params)]

    dec = make_engine(qwen3, block_size=BS, role=Role.DECODE, num_blocks=6)
    for e, sp in zip(exports, params):
        dec.import_kv(e, sp)
    assert dec.pool.num_free == 0 and not dec.scheduler.running
    done: dict = {}
    for _ in range(200):  # a deadlock would spin here with nothing scheduled
        done.update({o.request_id: o for o in dec.step() if o.finished})
        if len(done) == 2:
            break
    assert [done[e.request_id].token_ids for e in exports] == want
    assert dec.scheduler.num_preemptions >= 1
    assert_pool_clean(dec)
