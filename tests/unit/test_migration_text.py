"""A migrated stream's text (router/migration.py): with the `tiny` preset's real engine and
tokenizer in this process, a worker that dies after any number of tokens leaves the client
with exactly the fault-free text, finish reason and token count: stop strings that span the
migration point still stop it, and the text the dead engine held back (a possible stop
string's start, an incomplete UTF-8 character) is neither lost nor sent twice.

The prompt's greedy output has a run of tokens that each decode to a lone byte of a
multi-byte character (shown as U+FFFD once complete), so kill points inside it leave the dead
engine with an incomplete character.
"""
from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from worker_fakes import FakeWorker, router_over

from decode_worker.streams import to_chunk
from engine import CacheConfig, EngineConfig, LLMEngine, Role, SamplingParams
from engine.messages import Chunk, GenerateRequest
from engine.sampling import InvalidRequest
from router.config import RouterConfig
from router.errors import WorkerLost
from router.migration import continuation
from router.router import Router

pytestmark = pytest.mark.usefixtures("torch_single_thread")

_RNG = random.Random(0)
PROMPT = [_RNG.randrange(3, 4096) for _ in range(20)]
MAX_TOKENS = 24


def make_engine(role: Role = Role.MIXED) -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, role=role,
                                  cache=CacheConfig(num_blocks=64)))


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return make_engine()


@pytest.fixture(scope="module")
def free_text(engine) -> str:
    """The fault-free greedy text without stop strings, to cut stop strings from."""
    out = engine.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))[0]
    assert "\ufffd" in out.text and "ard" in out.text  # the incomplete-character run this file is about
    return out.text


def greedy(*stop: str) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, stop=stop)


class EngineWorker(FakeWorker):
    """A mixed worker over a real engine (shared by the fakes; one request at a time): one chunk
    per step; with `die_after`, its request is dropped and the stream fails after that many
    tokens, as a killed worker's does."""

    def __init__(self, worker_id: str, engine: LLMEngine, die_after: int | None = None):
        super().__init__(worker_id)
        self.engine, self.die_after = engine, die_after

    async def generate(self, req: GenerateRequest, first=None, prefill=None):
        self.requests.append(req)
        self.engine.add_request(req.request_id, req.prompt_token_ids, req.params)
        tokens = 0
        while True:
            if tokens == self.die_after:
                self.engine.abort(req.request_id)
                raise WorkerLost(self.worker_id)
            for out in self.engine.step():
                tokens += len(out.new_token_ids)
                yield to_chunk(out)
                if out.finished:
                    return

    async def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)


async def drain(router: Router, req: GenerateRequest) -> list[Chunk]:
    return [chunk async for chunk in router.generate(req)]


def stream_text(engine: LLMEngine, params: SamplingParams, die_after: int | None) -> list[Chunk]:
    dying, spare = EngineWorker("mixed-0", engine, die_after), EngineWorker("mixed-1", engine)
    router = router_over(RouterConfig(policy="round_robin", max_migrations=1), dying, spare)
    chunks = asyncio.run(drain(router, GenerateRequest("r", PROMPT, params)))
    assert engine.pool.num_referenced == 0 and not engine.seqs  # the dead attempt left nothing behind
    if die_after is not None:
        [cont] = spare.requests
        assert cont.params.resumed_tokens == die_after == len(cont.prompt_token_ids) - len(PROMPT)
    return chunks


def summary(chunks: list[Chunk]) -> tuple:
    last = chunks[-1]
    return ("".join(c.text for c in chunks), [t for c in chunks for t in c.token_ids], last.finish_reason,
            (last.usage.prompt_tokens, last.usage.completion_tokens))


STOPS = {
    "spanning the incomplete-character run": lambda t: (t[t.index(" eq"): t.index("bug")],),
    "two, the earlier wins": lambda t: (t[t.index("Traceback"): t.index("Ar") + 2], t[t.index("CAPITAL"):][:9]),
    "never matching (holdback only)": lambda t: ("@@never-here@@",),
    "none (incomplete characters only)": lambda t: (),
}


@pytest.mark.parametrize("case", list(STOPS))
def test_a_stream_migrated_after_any_token_has_the_fault_free_text(engine, free_text, case):
    params = greedy(*STOPS[case](free_text))
    fault_free = summary(stream_text(engine, params, None))
    text, tokens, reason, usage = fault_free
    if params.stop:
        assert reason == ("stop" if "never" not in case else "length")
    kill_points = range(1, len(tokens))
    for k in kill_points:
        migrated = stream_text(engine, params, k)
        assert migrated[-1].timing.migrations == 1
        assert summary(migrated) == fault_free, f"killed after {k} tokens"
    print(f"\n{case}: {len(kill_points)} kill points, text {text!r}, {reason}")


def run_disaggregated(pre: LLMEngine, dec: LLMEngine, req: GenerateRequest) -> tuple[str, list[int], str]:
    """`req` prefilled on a prefill-role engine and continued on a decode-role one, as in the cluster."""
    pre.add_request(req.request_id, req.prompt_token_ids, req.params)
    [first] = pre.step()
    text, tokens = first.new_text, list(first.new_token_ids)
    if first.finished:
        return text, tokens, first.finish_reason
    dec.import_kv(pre.export_kv(req.request_id), req.params)
    while True:
        for out in dec.step():
            text += out.new_text
            tokens += out.new_token_ids
            if out.finished:
                return text, tokens, out.finish_reason


def test_a_continuation_split_over_prefill_and_decode_engines_resumes_the_text_too(engine, free_text):
    """In the cluster the continuation's first token comes from a prefill worker and the rest from a
    decode worker: both seed their detokenizers from the params, and together give the rest of the text."""
    params = greedy(*STOPS["spanning the incomplete-character run"](free_text))
    want, want_tokens, want_reason, _ = summary(stream_text(engine, params, None))
    pre, dec = make_engine(Role.PREFILL), make_engine(Role.DECODE)
    req = GenerateRequest("d", PROMPT, params)
    head = stream_text(engine, params, None)  # one chunk a token: the first k are what the client got
    for k in range(1, len(want_tokens)):
        sent = [t for c in head for t in c.token_ids][:k]
        chars = sum(len(c.text) for c in head[:k])
        text, tokens, reason = run_disaggregated(pre, dec, continuation(req, sent, chars, k))
        assert (want[:chars] + text, sent + tokens, reason) == (want, want_tokens, want_reason), f"after {k}"
    assert pre.pool.num_referenced == dec.pool.num_referenced == 0


def test_resumed_tokens_must_leave_a_prompt(engine):
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("bad", [5, 6], dataclasses.replace(greedy(), resumed_tokens=2))
    assert err.value.field == "resumed_tokens"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(resumed_chars=-1)
    assert err.value.field == "resumed_chars"
