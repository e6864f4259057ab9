"""Request migration in the router, with fake workers (plain async WorkerClients, no Ray):
a worker that dies mid-stream hands the request to another from the tokens already sent, up
to RouterConfig.max_migrations times; beyond, the client gets StreamBroken with the count."""
from __future__ import annotations

import asyncio
import copy

import grpc
import pytest
from brigade_client.errors import TOKENS_SENT_KEY, Unavailable, from_rpc_error
from worker_fakes import FakeWorker, router_over

from engine.messages import Chunk, GenerateRequest
from engine.outputs import Usage
from engine.sampler import _mix
from engine.sampling import SamplingParams
from router.config import RouterConfig
from router.errors import NoWorker, StreamBroken, WorkerLost
from router.grpc.service import refusal
from router.http.answers import api_error
from router.migration import continuation, shifted_seed
from router.router import Router


def next_token(context: list[int]) -> int:
    """The fake model: each token depends on the whole context, so a continuation started from
    the wrong context gives different tokens."""
    return (sum(t * (i + 7) for i, t in enumerate(context)) + len(context)) % 997


def expected(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(next_token(prompt + out))
    return out


class FakeMixed(FakeWorker):
    """A mixed worker streaming one token a chunk; with `die_after`, the stream fails (as a dead
    worker's client reports it: WorkerLost) after that many tokens."""

    def __init__(self, worker_id: str, die_after: int | None = None):
        super().__init__(worker_id)
        self.die_after = die_after

    async def generate(self, req: GenerateRequest, first=None, prefill=None):
        self.requests.append(req)
        out: list[int] = []
        n = req.params.max_tokens
        for i in range(n):
            if self.die_after is not None and i == self.die_after:
                raise WorkerLost(self.worker_id)
            out.append(next_token(req.prompt_token_ids + out))
            last = i == n - 1
            yield Chunk(req.request_id, [out[-1]], "", last, "length" if last else None,
                        Usage(len(req.prompt_token_ids), len(out), 0) if last else None)


def make_router(max_migrations: int, *die_after: int | None) -> Router:
    workers = [FakeMixed(f"mixed-{i}", d) for i, d in enumerate(die_after)]
    return router_over(RouterConfig(policy="round_robin", max_migrations=max_migrations), *workers)


def worker(router: Router, worker_id: str) -> FakeMixed:
    return router.pool.workers[worker_id].client


async def drain(router: Router, req: GenerateRequest) -> tuple[list[int], list[Chunk], BaseException | None]:
    tokens, chunks = [], []
    try:
        async for chunk in router.generate(req):
            tokens += chunk.token_ids
            chunks.append(chunk)
    except Exception as exc:
        return tokens, chunks, exc
    return tokens, chunks, None


PROMPT = [11, 22, 33, 44, 55]


def test_beyond_max_migrations_the_client_gets_a_retriable_error_with_the_tokens_sent():
    router = make_router(0, 3, None)
    req = GenerateRequest("r0", PROMPT, SamplingParams(max_tokens=10, temperature=0.0))
    tokens, chunks, exc = asyncio.run(drain(router, req))
    print(f"\nmax_migrations=0: {len(tokens)} tokens sent, then {type(exc).__name__}: {exc}")
    assert isinstance(exc, StreamBroken) and isinstance(exc, NoWorker)  # both doors: UNAVAILABLE / 503
    assert exc.tokens_sent == 3 == len(tokens) and "3 tokens" in str(exc)
    assert tokens == expected(PROMPT, 3) and not any(c.finished for c in chunks)
    assert router.admission.running == 0 and not router.dispatch.active


def test_a_dying_worker_hands_the_rest_to_another_and_the_client_sees_every_token_once():
    router = make_router(2, 4, None)
    spare = worker(router, "mixed-1")
    req = GenerateRequest("r1", PROMPT, SamplingParams(max_tokens=12, temperature=0.0))
    tokens, chunks, exc = asyncio.run(drain(router, req))
    assert exc is None
    assert tokens == expected(PROMPT, 12)
    cont = spare.requests[0]
    assert cont.prompt_token_ids == PROMPT + tokens[:4] and cont.params.max_tokens == 8
    assert cont.request_id != "r1" and all(c.request_id == "r1" for c in chunks)
    last = chunks[-1]
    assert last.finished and last.timing.migrations == 1 and last.decode_worker == "mixed-1"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 12)
    assert all(w.inflight == 0 for w in router.pool.workers.values())


def test_every_worker_dying_ends_retriable_once_none_is_left():
    router = make_router(5, 2, 3)
    req = GenerateRequest("r2", PROMPT, SamplingParams(max_tokens=20, temperature=0.0))
    tokens, _, exc = asyncio.run(drain(router, req))
    # 2 from the first, 3 more from the second (its continuation), then no worker is left to try.
    assert isinstance(exc, StreamBroken) and exc.tokens_sent == 5 == len(tokens)
    assert tokens == expected(PROMPT, 5)


@pytest.mark.parametrize("seed", [0, 1, 12345, 2**63 - 1])
def test_a_continuations_shifted_seed_keys_every_position_like_the_original(seed):
    for offset in (1, 7, 1000):
        for pos in (0, 1, 50):
            assert _mix(shifted_seed(seed, offset), pos) == _mix(seed, pos + offset)


def test_continuation_extends_the_prompt_and_shortens_max_tokens():
    req = GenerateRequest("x", [1, 2], SamplingParams(max_tokens=9, seed=5, temperature=0.7))
    cont = continuation(req, [3, 4, 5], 11, 1)
    assert cont.prompt_token_ids == [1, 2, 3, 4, 5] and cont.params.max_tokens == 6
    assert cont.params.temperature == 0.7 and cont.params.seed == shifted_seed(5, 3)
    assert (cont.params.resumed_tokens, cont.params.resumed_chars) == (3, 11)
    assert req.prompt_token_ids == [1, 2] and req.params.max_tokens == 9  # the original is untouched


def test_both_doors_answer_stream_broken_as_retriable_with_the_count():
    # deepcopy goes through __reduce__, as Ray does when the error crosses from the router actor
    exc = copy.deepcopy(StreamBroken(7, "worker decode-0 died after 7 tokens were sent; retry"))
    assert exc.tokens_sent == 7 and "7 tokens" in str(exc)
    refused = refusal(exc)
    assert refused.code == grpc.StatusCode.UNAVAILABLE and (TOKENS_SENT_KEY, "7") in refused.trailers()
    assert api_error(exc).status == 503 and "7 tokens" in str(api_error(exc))

    class RpcError(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return str(exc)

    err = from_rpc_error(RpcError(), refused.trailers())
    assert isinstance(err, Unavailable) and err.tokens_sent == 7
