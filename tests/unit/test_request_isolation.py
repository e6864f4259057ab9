"""One request never takes an engine down: hostile field values are refused before
they reach the engine, and a failure while sampling, checking stops or detokenizing one request
fails that request alone (with a log id) while the rest of its batch goes on. In-process: the
real engine on the `tiny` preset; the only stand-ins wrap our own Sampler and sinks."""
from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest
import torch
from helpers import assert_pool_clean

from engine import CacheConfig, EngineConfig, InvalidRequest, LLMEngine, SamplingParams
from engine.engine_loop import EngineDied, EngineLoop, RequestFailed
from engine.sampler import Sampler

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPTS = [[5, 17, 300, 2, 99], [7, 8, 9], [1000, 3, 4, 5, 6, 7]]
POISON_SEED = 666  # the stand-in sampler below fails any row with this seed


@pytest.fixture
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64)))


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, **kw)


def run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, object]:
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PROMPTS[i], p)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


class PoisonedSampler:
    """Our Sampler, failing any batch that holds a row with POISON_SEED (as the int64 overflow
    of a sampled row once did, for the whole batch)."""

    def __init__(self, inner: Sampler):
        self.inner = inner

    def __call__(self, logits, params, positions):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("Overflow when unpacking long")
        return self.inner(logits, params, positions)


HOSTILE = [
    (dict(top_k=9223372036854775808), "top_k"),
    (dict(top_k=2**31 - 1), "top_k"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids"),
    (dict(stop_token_ids=[1] * 65), "stop_token_ids"),
    (dict(max_tokens=9223372036854775808), "max_tokens"),
]


@pytest.mark.parametrize(("fields", "field"), HOSTILE)
def test_hostile_fields_are_refused_and_the_engine_serves_on(engine: LLMEngine, fields, field) -> None:
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", PROMPTS[0], SamplingParams(**({"max_tokens": 4, "top_p": 0.5} | fields)))
    assert err.value.field == field
    assert run(engine, [greedy()])["r0"].finish_reason == "length"
    assert_pool_clean(engine)


@pytest.mark.parametrize(("fields", "field"), [
    (dict(seed=2**64), "seed"),
    (dict(seed=-(2**63) - 1), "seed"),
    (dict(temperature=10**400), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=1.5), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
    (dict(stop=["x" * 257]), "stop"),
    (dict(stop=["x" * 100] * 11), "stop"),
    (dict(stop=[3]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=["1"]), "stop_token_ids"),
    (dict(max_tokens=2**31), "max_tokens"),
])
def test_sampling_params_bound_every_field(fields, field) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**fields)
    assert err.value.field == field
    assert len(str(err.value)) < 200  # a huge value is not echoed whole


def test_sampling_params_largest_valid_values() -> None:
    p = SamplingParams(seed=2**64 - 1, stop=["x" * 256] * 4, stop_token_ids=[0] * 64, temperature=10**300)
    assert p.seed == 2**64 - 1 and isinstance(p.temperature, float)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(temperature=1e-9).greedy  # dividing by it would overflow the logits


def test_the_sampler_clamps_top_k_to_the_vocabulary() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    # Built past the engine's admission check (which refuses top_k > vocabulary) on purpose.
    huge = SamplingParams(temperature=0.7, top_k=2**63, seed=1)
    off = SamplingParams(temperature=0.7, top_k=-1, seed=1)
    tokens, _ = Sampler(torch.device("cpu"), 0)(logits, [huge] * 3, [0, 1, 2])
    assert tokens == Sampler(torch.device("cpu"), 0)(logits, [off] * 3, [0, 1, 2])[0]


def test_a_failure_sampling_one_request_fails_it_alone(engine: LLMEngine) -> None:
    alone = run(engine, [greedy(), greedy(), greedy()])
    engine.sampler = PoisonedSampler(engine.sampler)
    done = run(engine, [greedy(), greedy(seed=POISON_SEED), greedy()])
    bad = done["r1"]
    assert bad.finished and bad.finish_reason == "error" and "log id" in bad.error
    assert "Overflow" not in bad.error  # no internal text for the client
    assert [done[r].token_ids for r in ("r0", "r2")] == [alone[r].token_ids for r in ("r0", "r2")]
    assert all(done[r].error is None for r in ("r0", "r2"))
    assert_pool_clean(engine)


class BrokenDetokenizer:
    def update(self, token_ids):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def test_a_failure_detokenizing_one_request_fails_it_alone(engine: LLMEngine) -> None:
    alone = run(engine, [greedy(), greedy()])
    engine.add_request("r0", PROMPTS[0], greedy())
    engine.add_request("r1", PROMPTS[1], greedy())
    engine.detoks["r1"] = BrokenDetokenizer()
    done = {}
    while engine.has_unfinished():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["r1"].finish_reason == "error" and "stop checks or detokenizing" in done["r1"].error
    assert done["r0"].token_ids == alone["r0"].token_ids
    assert_pool_clean(engine)


def collect(loop: EngineLoop, rid: str, prompt, params) -> Future:
    """The outputs of one request through the loop: a future of its final output or exception."""
    result: Future = Future()

    def sink(out) -> None:
        if isinstance(out, BaseException):
            result.set_exception(out)
        elif out.finished:
            result.set_result(out)
    loop.add_request(rid, prompt, params, sink).result(timeout=30)
    return result


def test_the_loop_fails_one_request_with_request_failed_and_lives_on(engine: LLMEngine) -> None:
    engine.sampler = PoisonedSampler(engine.sampler)
    loop = EngineLoop(engine).start()
    try:
        bad = collect(loop, "bad", PROMPTS[0], greedy(seed=POISON_SEED))
        good = collect(loop, "good", PROMPTS[1], greedy())
        with pytest.raises(RequestFailed, match="log id"):
            bad.result(timeout=60)
        assert good.result(timeout=60).finish_reason == "length"
        assert loop.alive
        assert loop.call(lambda e: e.pool.num_referenced).result(timeout=30) == 0
    finally:
        loop.stop()


def test_a_sink_that_raises_fails_its_own_request_not_the_loop(engine: LLMEngine) -> None:
    loop = EngineLoop(engine).start()
    told: list[BaseException] = []
    first = threading.Event()

    def broken_sink(out) -> None:
        if isinstance(out, BaseException):
            told.append(out)
            return
        first.set()
        raise KeyError("a bug in a worker's sink")
    try:
        loop.add_request("broken", PROMPTS[0], greedy(), broken_sink).result(timeout=30)
        good = collect(loop, "good", PROMPTS[1], greedy())
        assert good.result(timeout=60).finish_reason == "length"
        assert first.is_set() and len(told) == 1 and isinstance(told[0], RequestFailed)
        assert loop.alive
        assert loop.call(lambda e: (e.pool.num_referenced, e.has_unfinished())).result(timeout=30) == (0, False)
    finally:
        loop.stop()


def test_a_loop_that_breaks_fails_pending_calls_with_engine_died(engine: LLMEngine) -> None:
    """A failure outside any step (here the engine's own bookkeeping raises): every request and
    every queued call is answered with EngineDied, none waits forever."""
    loop = EngineLoop(engine).start()
    try:
        running = collect(loop, "running", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=200,
                                                                      ignore_eos=True))

        def boom() -> bool:
            raise RuntimeError("bookkeeping bug")
        engine.has_runnable = boom  # read by the loop thread between calls and steps
        with pytest.raises(EngineDied):
            running.result(timeout=30)
        with pytest.raises(EngineDied):
            loop.call(lambda e: None).result(timeout=30)
        assert not loop.alive
    finally:
        loop.stop()


def test_a_checked_request_is_checked_only_against_the_engines_own_pool(engine: LLMEngine) -> None:
    """A worker's engine trusts the door's check (checked=True): the model-shape checks do not
    run again, but a request whose output can never fit this engine's pool is still refused,
    with the field named, and the engine serves on."""
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("big", PROMPTS[0], SamplingParams(max_tokens=64 * engine.block_size), checked=True)
    assert err.value.field == "max_tokens" and "the pool has 64" in str(err.value)
    engine.add_request("ok", PROMPTS[1], greedy(), checked=True)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["ok"].finish_reason == "length"
    assert_pool_clean(engine)


@pytest.mark.parametrize("bad_id", [-1, "vocab"])
def test_a_token_id_outside_the_vocabulary_is_refused_even_when_checked(engine: LLMEngine, bad_id) -> None:
    """A request that reached a worker without a door's check (checked=True, or a decode-side
    admit) and carries an id outside the embedding is refused naming the prompt, instead of
    failing the forward pass of the whole batch; the engine serves on."""
    vocab = engine.model_config.vocab_size
    prompt = [5, 6, vocab if bad_id == "vocab" else bad_id]
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", prompt, greedy(), checked=True)
    assert err.value.field == "prompt" and "outside the vocabulary" in str(err.value)
    blocks = engine.reserve("bad-admit", len(prompt) + 1)
    assert blocks
    with pytest.raises(InvalidRequest):
        engine.admit("bad-admit", prompt, 3, greedy())
    engine.add_request("ok", PROMPTS[1], greedy(), checked=True)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["ok"].finish_reason == "length"
    assert_pool_clean(engine)
