"""Backpressure into the engine: a request whose reader is behind is held, keeping its
KV, while the rest of the batch decodes; released, it finishes with the same tokens."""
from __future__ import annotations

import asyncio
import time

import pytest
from helpers import assert_pool_clean

from decode_worker.streams import HOLD_AT, RESUME_AT, OutputStream
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.engine_loop import EngineLoop

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT = [5, 17, 300, 2, 99]
MAX_TOKENS = 120


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64)))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def plain_tokens(engine: LLMEngine, prompt: list[int]) -> list[int]:
    return engine.generate([prompt], greedy())[0].token_ids


def test_a_held_request_stops_decoding_and_the_rest_of_the_batch_goes_on(engine: LLMEngine) -> None:
    want = {"a": plain_tokens(engine, PROMPT), "b": plain_tokens(engine, [7, 8, 9])}
    engine.add_request("a", PROMPT, greedy())
    engine.add_request("b", [7, 8, 9], greedy())
    for _ in range(3):
        engine.step()
    engine.hold("a", True)
    a = engine.seqs["a"]
    frozen, blocks = a.num_tokens, list(a.block_table)
    got: dict[str, list[int]] = {}
    while engine.has_runnable():
        for out in engine.step():
            assert out.request_id != "a", "a held request must not decode"
            if out.finished:
                got[out.request_id] = out.token_ids
    assert "b" in got and a.num_tokens == frozen and a.block_table == blocks  # its KV kept
    assert engine.has_unfinished() and engine.stats()["held"] == 1  # idle, not finished
    engine.hold("a", False)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.token_ids
    assert got == want
    assert_pool_clean(engine)


def test_holding_an_unknown_or_finished_request_is_ignored(engine: LLMEngine) -> None:
    engine.hold("nobody", True)
    engine.generate([PROMPT], greedy(4))
    assert not engine.has_unfinished()


def test_a_reader_that_falls_behind_holds_its_request_in_the_engine(engine: LLMEngine) -> None:
    """Through the loop thread, as a decode worker runs it: nothing reads until the engine has
    held the request, which has then generated about HOLD_AT tokens of MAX_TOKENS; reading
    releases it and the whole answer arrives, token-identical."""
    want = plain_tokens(engine, PROMPT)
    loop = EngineLoop(engine).start()

    def stats() -> dict:
        return loop.call(lambda e: e.stats()).result(timeout=30)

    def generated() -> int:
        return loop.call(lambda e: e.seqs["r"].num_tokens - len(PROMPT)).result(timeout=30)

    async def main() -> tuple[int, int, list[int], list[bool]]:
        stream = OutputStream(lambda held: loop.call(lambda e: e.hold("r", held)))
        loop.add_request("r", PROMPT, greedy(), stream.sink).result(timeout=30)
        deadline = time.monotonic() + 60
        while stats()["held"] != 1:
            assert time.monotonic() < deadline, f"never held; {stats()}"
            await asyncio.sleep(0.01)
        at_hold = generated()
        await asyncio.sleep(0.3)  # an engine that ignored the hold would run on meanwhile
        later = generated()
        tokens, held_while_reading = [], []
        async for chunk in stream.chunks():
            tokens += chunk.token_ids
            held_while_reading.append(stream.held)
        return at_hold, later, tokens, held_while_reading

    try:
        at_hold, later, tokens, held = asyncio.run(main())
    finally:
        loop.stop()
    # The hold reaches the engine one step after the HOLD_AT-th chunk was delivered.
    assert HOLD_AT <= at_hold <= HOLD_AT + 2 and later == at_hold
    assert tokens == want
    assert held[0] and not held[-1]  # released once the reader was down to RESUME_AT unread
    assert sum(held) >= HOLD_AT - RESUME_AT - 1
    assert_pool_clean(engine)
