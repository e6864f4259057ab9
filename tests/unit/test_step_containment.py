"""An exception in one request's own work inside a step fails that request alone.

A fault is injected for one request of several running together, at each stage of a step
where work is one request's: its prefix match and block hashes, a lower cache tier's
load-back, its scheduling and block allocation, its inputs to the forward pass, its sampling,
its blocks offered to the prefix cache, its stop checks and its detokenizing. Each time that
request finishes with finish_reason "error" and a log id, the engine steps on, the other
requests' tokens are those of a run without the fault, and no KV block stays referenced. A
failure that is no one request's (the model's forward over the batch) still stops the engine
loop. Real engines on the `tiny` preset; faults wrap our own functions for one request id.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future

import pytest
from helpers import assert_pool_clean, greedy, make_engine, make_prompts, run_all
from hicache_helpers import tiered_engine

from engine import LLMEngine
from engine.block_pool import NoFreeBlocks
from engine.engine_loop import EngineDied, EngineLoop, RequestFailed
from engine.scheduler import Scheduler
from engine.sequence import Sequence

pytestmark = pytest.mark.usefixtures("torch_single_thread")

BAD = "bad"
SHARED = make_prompts([12], seed=7)[0]  # 3 full blocks of 4 that BAD shares with WARM
WARM = [*SHARED, *make_prompts([5], seed=8)[0]]
REQUESTS = {"r0": make_prompts([13], seed=1)[0], BAD: [*SHARED, *make_prompts([6], seed=2)[0]],
            "r2": make_prompts([9], seed=3)[0], "r3": make_prompts([21], seed=4)[0]}
MAX_TOKENS = 8


class InjectedFault(RuntimeError):
    """What every fault below raises (a log line that shows it names this)."""


def plain() -> LLMEngine:
    return make_engine("tiny", num_blocks=64)


def tiered() -> LLMEngine:
    return tiered_engine(None, num_blocks=64)  # host tier only: a load-back on every prefix hit


def serve(engine: LLMEngine, fault: Callable[[LLMEngine, pytest.MonkeyPatch], None] | None = None,
          monkeypatch: pytest.MonkeyPatch | None = None) -> dict:
    """WARM alone (BAD's prefix is then cached), then REQUESTS together with `fault` installed,
    then one more request after them: the final output of each."""
    done = {}
    engine.add_request("warm", WARM, greedy(MAX_TOKENS))
    done |= run_all(engine)
    for rid, prompt in REQUESTS.items():
        engine.add_request(rid, prompt, greedy(MAX_TOKENS))
    if fault is not None:
        fault(engine, monkeypatch)
    done |= run_all(engine)
    if monkeypatch is not None:
        monkeypatch.undo()
    engine.add_request("after", REQUESTS["r0"], greedy(MAX_TOKENS))
    return done | run_all(engine)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    return {rid: out.token_ids for rid, out in serve(plain()).items()}


def _fail_for_bad(method: Callable, when: Callable[[Sequence], bool] = lambda seq: True) -> Callable:
    """`method` (taking a Sequence after self), raising for BAD when `when(seq)`."""
    def wrapped(self, seq, *args, **kwargs):
        if seq.request_id == BAD and when(seq):
            raise InjectedFault(f"{method.__name__} of {seq.request_id}")
        return method(self, seq, *args, **kwargs)
    return wrapped


def _hashing_fails_for_bad(when: Callable[[Sequence], bool]) -> Callable:
    real = Sequence.update_block_hashes

    def update_block_hashes(seq, block_size, model_id):
        if seq.request_id == BAD and when(seq):
            raise InjectedFault(f"hashing the blocks of {seq.request_id}")
        return real(seq, block_size, model_id)
    return update_block_hashes


def fault_prefix_match(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """Hashing BAD's blocks raises when it is first scheduled (the prefix match)."""
    mp.setattr(Sequence, "update_block_hashes", _hashing_fails_for_bad(lambda seq: True))


def fault_prefix_cache(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """Hashing BAD's blocks raises once its prompt was computed (offering blocks to the cache)."""
    mp.setattr(Sequence, "update_block_hashes", _hashing_fails_for_bad(lambda seq: seq.num_computed > 0))


def fault_load_back(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """The host tier's load-back raises for BAD, after its device hit was referenced."""
    real = engine.hicache.load_back

    def load_back(seq, hashes, num_device):
        if seq.request_id == BAD:
            if num_device != 3:  # WARM's blocks, referenced now, to be freed with BAD (not contained)
                pytest.fail(f"BAD's device hit is {num_device} blocks, not WARM's 3")
            raise InjectedFault("load_back")
        return real(seq, hashes, num_device)
    mp.setattr(engine.hicache, "load_back", load_back)


def fault_load_back_copy(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """BAD's prefix is only in the host tier, and copying it back into the blocks the load-back
    allocated for it raises."""
    engine.pool.release(engine.pool.allocate(engine.pool.num_free))  # every cached block leaves L1
    assert len(engine.cache) == 0

    def write_blocks(block_ids, kv):
        raise InjectedFault("copying KV into the device pool")
    mp.setattr(engine.runner, "write_blocks", write_blocks)


def fault_chunk(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """Sizing BAD's first chunk raises (admission from the queue)."""
    mp.setattr(Scheduler, "_chunk", _fail_for_bad(Scheduler._chunk))


def fault_allocation(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """The pool refuses BAD's blocks mid-decode (a running sequence growing)."""
    asking: list[Sequence] = []
    needed, allocate = Scheduler._blocks_needed, engine.pool.allocate

    def blocks_needed(self, seq, n):
        asking[:] = [seq]
        return needed(self, seq, n)

    def pool_allocate(n):
        seq = asking.pop() if asking else None
        if seq is not None and seq.request_id == BAD and len(seq.output_token_ids) >= 3:
            raise NoFreeBlocks(f"need {n} KV blocks (injected)")
        return allocate(n)
    mp.setattr(Scheduler, "_blocks_needed", blocks_needed)
    mp.setattr(engine.pool, "allocate", pool_allocate)


def fault_inputs(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """A bookkeeping slip leaves BAD's block table a block short of what its chunk writes."""
    schedule, slipped = engine.scheduler.schedule, []

    def short_table():
        batch = schedule()
        for s in batch:
            if s.seq.request_id == BAD and not slipped:
                slipped.append(s.seq.block_table.pop())
                engine.pool.release(slipped[-1:])
        return batch
    mp.setattr(engine.scheduler, "schedule", short_table)


def fault_sampling(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """The sampler raises on any batch that holds BAD's row."""
    bad, sampler = engine.seqs[BAD].params, engine.sampler

    def sample(logits, params, positions):
        if any(p is bad for p in params):
            raise InjectedFault("sampler")
        return sampler(logits, params, positions)
    mp.setattr(engine, "sampler", sample)


def fault_stop_check(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """Checking BAD's stops raises at its third output token."""
    mp.setattr(engine, "_stop_reason", _fail_for_bad(type(engine)._stop_reason,
                                                     lambda seq: len(seq.output_token_ids) >= 3).__get__(engine))


def fault_detokenize(engine: LLMEngine, mp: pytest.MonkeyPatch) -> None:
    """Detokenizing BAD's output raises at its second token."""
    detok = engine.detoks[BAD]
    update = detok.update

    def broken(token_ids):
        if len(token_ids) >= 2:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        update(token_ids)
    mp.setattr(detok, "update", broken)


STAGES = [
    (fault_prefix_match, plain, "scheduling"),
    (fault_load_back, tiered, "scheduling"),
    (fault_load_back_copy, tiered, "scheduling"),
    (fault_chunk, plain, "scheduling"),
    (fault_allocation, plain, "scheduling"),
    (fault_inputs, plain, "input preparation"),
    (fault_sampling, plain, "sampling"),
    (fault_prefix_cache, plain, "prefix caching"),
    (fault_stop_check, plain, "stop checks or detokenizing"),
    (fault_detokenize, plain, "stop checks or detokenizing"),
]


@pytest.mark.parametrize(("fault", "build", "stage"), STAGES, ids=[f.__name__ for f, _, _ in STAGES])
def test_a_fault_in_one_requests_work_fails_it_alone(fault, build, stage, reference, monkeypatch, caplog) -> None:
    engine = build()
    with caplog.at_level(logging.ERROR, logger="engine.llm_engine"):
        done = serve(engine, fault, monkeypatch)
    bad = done[BAD]
    assert bad.finished and bad.finish_reason == "error"
    assert bad.error.startswith(f"the request failed in the engine ({stage}); log id ")
    assert "injected" not in bad.error.lower() and "InjectedFault" not in bad.error  # no internal text
    assert len(bad.token_ids) < MAX_TOKENS
    logged = [r for r in caplog.records if r.name == "engine.llm_engine" and BAD in r.getMessage()]
    assert len(logged) == 1 and logged[0].exc_info is not None  # one line, with its traceback
    assert bad.error.split("log id ")[1] in logged[0].getMessage()
    for rid in ("warm", "r0", "r2", "r3", "after"):  # the engine stepped on, the others untouched
        assert done[rid].finish_reason == "length" and done[rid].error is None
        assert done[rid].token_ids == reference[rid], rid
    assert_pool_clean(engine)
    assert BAD not in engine.seqs and BAD not in engine.detoks


def test_a_failure_of_the_whole_batch_still_stops_the_loop(monkeypatch) -> None:
    """The model's forward is no one request's: the loop dies and every request is told."""
    engine = plain()

    def forward(batch):
        raise InjectedFault("the forward pass")
    monkeypatch.setattr(engine.runner, "run", forward)
    loop = EngineLoop(engine).start()
    try:
        for fut in submit_all(loop).values():
            with pytest.raises(EngineDied):
                fut.result(timeout=60)
        assert not loop.alive
    finally:
        loop.stop()


def test_the_loop_lives_on_through_a_fault_in_one_requests_prefix_match(monkeypatch) -> None:
    engine = plain()
    fault_prefix_match(engine, monkeypatch)
    loop = EngineLoop(engine).start()
    try:
        futures = submit_all(loop)
        with pytest.raises(RequestFailed, match="log id"):
            futures.pop(BAD).result(timeout=60)
        assert all(fut.result(timeout=60).finish_reason == "length" for fut in futures.values())
        assert loop.alive
        assert loop.call(lambda e: (e.pool.num_referenced, e.has_unfinished())).result(timeout=30) == (0, False)
    finally:
        loop.stop()


def submit_all(loop: EngineLoop) -> dict[str, Future]:
    """REQUESTS, queued in one call (so in one step), each with a future of its final output
    or of the exception its sink was handed."""
    futures = {rid: Future() for rid in REQUESTS}

    def sink_of(fut: Future) -> Callable:
        def sink(out) -> None:
            if isinstance(out, BaseException):
                fut.set_exception(out)
            elif out.finished:
                fut.set_result(out)
        return sink

    def add_all(engine: LLMEngine) -> None:
        for rid, prompt in REQUESTS.items():
            engine.add_request(rid, prompt, greedy(MAX_TOKENS))
            loop.watch_now(rid, sink_of(futures[rid]))
    loop.call(add_all).result(timeout=30)
    return futures
