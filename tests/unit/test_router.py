"""The router over plain async fakes of WorkerClient (no Ray): one disaggregated attempt, the
first token leaving from the prefill result, worker loss, abort, health, pairing, and the
one error table both doors answer from."""
from __future__ import annotations

import asyncio

import grpc
import pytest
from worker_fakes import FakeWorker, router_over

from engine.messages import Aborted, Chunk, GenerateRequest, KVHandle, PrefillResult, Timing, WorkerHealth
from engine.outputs import Usage
from engine.sampling import InvalidRequest, SamplingParams
from router import errors
from router.config import RouterConfig
from router.errors import ModelNotFound, NoWorker, Overloaded, StreamBroken, WorkerLost
from router.grpc.service import refusal
from router.http.answers import api_error

PROMPT = [5, 6, 7, 8]


def token(context: list[int]) -> int:
    return (sum(context) * 31 + len(context)) % 1000


class Prefill(FakeWorker):
    """Answers the first token; `sent`: the hand-offs whose KV it was told to send (with the request)."""

    def __init__(self, worker_id: str, die: bool = False):
        super().__init__(worker_id, "prefill")
        self.die, self.sent = die, []

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        self.requests.append(req)
        if self.die:
            raise WorkerLost(self.worker_id)
        finished = req.params.max_tokens == 1
        if handle is not None and not finished:
            self.sent.append(handle)
        return PrefillResult(req.request_id, token(req.prompt_token_ids), "x", finished,
                             "length" if finished else None, Usage(len(req.prompt_token_ids), 1, 0), None, 0.0, 0.01,
                             kv_sent=handle is not None)


class Decode(FakeWorker):
    """Takes the KV its reservation's handle names, then streams the tokens after the first, one
    a chunk; waits for `release` before it takes the KV when it is given."""

    def __init__(self, worker_id: str, release: asyncio.Event | None = None):
        super().__init__(worker_id, "decode")
        self.release, self.reserved, self.started, self.taken = release, [], False, []

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        self.reserved.append((request_id, num_tokens))
        return await super().reserve(request_id, num_tokens, prefill_id)

    async def generate(self, req, first=None, handle=None):
        self.started = True
        self.requests.append(req)
        if self.release is not None:
            await self.release.wait()
        assert handle.decode_id == self.worker_id and first.kv_sent
        self.taken.append(handle)
        out = [first.first_token_id]
        n = req.params.max_tokens
        for i in range(1, n):
            out.append(token(req.prompt_token_ids + out))
            last = i == n - 1
            yield Chunk(req.request_id, [out[-1]], "y", last, "length" if last else None,
                        Usage(len(req.prompt_token_ids), len(out), 0) if last else None,
                        timing=Timing(transfer_s=0.5, transfer_bytes=4096) if i == 1 else None)


def expected(n: int) -> list[int]:
    out: list[int] = []
    for _ in range(n):
        out.append(token(PROMPT + out))
    return out


def disagg(*workers: FakeWorker, **cfg):
    prefills = [w.worker_id for w in workers if w.role == "prefill"]
    decodes = [w.worker_id for w in workers if w.role == "decode"]
    peers = {p: set(decodes) for p in prefills} | {d: set(prefills) for d in decodes}
    return router_over(RouterConfig(policy="round_robin", **cfg), *workers, colocated=False, peers=peers)


def req(rid: str, max_tokens: int = 6) -> GenerateRequest:
    return GenerateRequest(rid, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_the_first_token_reaches_the_client_before_the_kv_moves():
    async def main():
        release = asyncio.Event()
        prefill, decode = Prefill("prefill-0"), Decode("decode-0", release)
        router = disagg(prefill, decode)
        stream = router.generate(req("r"))
        first = await asyncio.wait_for(stream.__anext__(), 5)
        assert first.token_ids == expected(1) and not decode.taken  # the decode worker has not started it
        assert decode.reserved == [("r", len(PROMPT))]  # the blocks were held before the prefill
        release.set()
        rest = [c async for c in stream]
        return first, rest, prefill, decode, router

    first, rest, prefill, decode, router = asyncio.run(main())
    assert [t for c in [first, *rest] for t in c.token_ids] == expected(6)
    # The prefill worker got the reservation's handle with the request, and the decode worker the same one.
    assert prefill.sent == decode.taken == [KVHandle("r", "prefill-0", "decode-0", len(PROMPT))]
    last = rest[-1]
    assert last.finished and (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
    assert last.timing.transfer_s == 0.5 and last.timing.transfer_bytes == 4096
    assert 0 < last.timing.ttft_s <= last.timing.total_s
    assert all(w.inflight == 0 and w.queued_tokens == 0 for w in router.pool.workers.values())


def test_a_one_token_answer_needs_no_decode_worker():
    decode = Decode("decode-0")
    router = disagg(Prefill("prefill-0"), decode)
    chunks = asyncio.run(_drain(router, req("one", max_tokens=1)))
    assert [c.token_ids for c in chunks] == [expected(1)] and chunks[-1].finish_reason == "length"
    assert chunks[-1].decode_worker is None and decode.reserved == [] and not decode.started


def test_a_prefill_worker_lost_before_the_first_token_frees_the_reservation_and_moves_on():
    dead, live, decode = Prefill("prefill-0", die=True), Prefill("prefill-1"), Decode("decode-0")
    router = disagg(dead, live, decode, max_migrations=1)
    chunks = asyncio.run(_drain(router, req("m")))
    assert [t for c in chunks for t in c.token_ids] == expected(6)
    assert decode.aborted == ["m"]  # the first attempt's reservation, freed at once
    assert [r.request_id for r in live.requests] == ["m#m1"] and chunks[-1].timing.migrations == 1
    assert chunks[-1].prefill_worker == "prefill-1"


def test_no_decode_worker_paired_is_no_worker_before_any_prefill():
    prefill = Prefill("prefill-0")
    router = router_over(RouterConfig(), prefill, Decode("decode-0"), colocated=False)  # never paired
    with pytest.raises(NoWorker, match="prefill"):
        asyncio.run(_drain(router, req("n")))
    assert prefill.requests == [] and router.admission.running == 0


def test_abort_mid_stream_ends_with_abort_on_both_workers():
    async def main():
        release = asyncio.Event()
        prefill, decode = Prefill("prefill-0"), Decode("decode-0", release)
        router = disagg(prefill, decode)
        async def abort_ends_the_stream(request_id):  # as a real decode worker's stream does
            decode.aborted.append(request_id)
            release.set()
        decode.abort = abort_ends_the_stream

        stream = router.generate(req("a", max_tokens=50))
        await stream.__anext__()
        assert await router.abort("a")
        return [c async for c in stream], prefill, decode, router

    chunks, prefill, decode, router = asyncio.run(main())
    assert prefill.aborted == ["a"] and decode.aborted == ["a"]
    assert not router.dispatch.active and not router.dispatch.aborted and chunks


def test_health_checks_eject_a_dead_worker_and_close_a_broken_pair():
    class Reporting(FakeWorker):
        def __init__(self, worker_id, role, report):
            super().__init__(worker_id, role)
            self.report, self.closed = report, []

        async def health(self):
            return self.report

        async def disconnect(self, peer_id):
            self.closed.append(peer_id)

    dead = Reporting("prefill-0", "prefill", WorkerHealth("prefill-0", "prefill", alive=False))
    broken = Reporting("prefill-1", "prefill", WorkerHealth("prefill-1", "prefill", alive=True, free_blocks=9,
                                                            broken_pairs=("decode-0",)))
    decode = Reporting("decode-0", "decode", WorkerHealth("decode-0", "decode", alive=True))
    router = disagg(dead, broken, decode)
    pool = router.pool

    async def check():
        for ref in list(pool.workers.values()):
            await pool._check(ref)
    asyncio.run(check())
    refs = pool.workers
    assert not refs["prefill-0"].healthy and refs["prefill-1"].healthy and refs["prefill-1"].free_blocks == 9
    assert "decode-0" not in refs["prefill-1"].peers and "prefill-1" not in refs["decode-0"].peers
    assert broken.closed == ["decode-0"] and decode.closed == ["prefill-1"]
    assert [w.worker_id for w in pool.live("prefill")] == ["prefill-1"]


def test_a_joining_worker_is_paired_with_every_healthy_counterpart():
    async def main():
        router = router_over(RouterConfig(), colocated=False)
        for w in (Decode("decode-0"), Decode("decode-1"), Prefill("prefill-0")):
            await router.add_worker(w)
        return router

    router = asyncio.run(main())
    assert router.pool.workers["prefill-0"].peers == {"decode-0", "decode-1"}
    assert router.pool.workers["prefill-0"].client.peers == ["decode-0", "decode-1"]
    # Each decode worker is told whom to expect: its rendezvous refuses a join under another name.
    assert [router.pool.workers[d].client.expected for d in ("decode-0", "decode-1")] == [["prefill-0"]] * 2
    # Both sides of a pairing get its ticket from the router (never from the rendezvous store),
    # one fresh ticket per pairing.
    tickets = [router.pool.workers[d].client.tickets for d in ("decode-0", "decode-1")]
    assert router.pool.workers["prefill-0"].client.tickets == [t for (t,) in tickets]
    assert len(set(router.pool.workers["prefill-0"].client.tickets)) == 2 and all(len(t) >= 16 for (t,) in tickets)


def test_a_front_that_does_not_own_the_pairs_routes_over_the_reported_ones_and_never_pairs():
    """An extra front's router (owns_pairs=False): pairs come from the workers' health reports;
    it never connects, accepts, disconnects or rebuilds a pair (the owner's router does)."""
    class Reporting(FakeWorker):
        def __init__(self, worker_id, role, peers=(), broken=()):
            super().__init__(worker_id, role)
            self.report_peers, self.broken, self.calls = tuple(peers), tuple(broken), []

        async def health(self):
            return WorkerHealth(self.worker_id, self.role, alive=True, peers=self.report_peers,
                                broken_pairs=self.broken)

        async def accept(self, ticket, expect=None):
            self.calls.append("accept")

        async def connect(self, decode_id, address, ticket):
            self.calls.append("connect")

        async def disconnect(self, peer_id):
            self.calls.append(f"disconnect {peer_id}")

    from router.router import Router

    prefill = Reporting("prefill-0", "prefill", peers=["decode-0"])
    lone = Reporting("prefill-1", "prefill")  # not paired (yet): no request goes there
    decode = Reporting("decode-0", "decode", peers=["prefill-0"])

    async def main():
        router = Router(RouterConfig(), colocated=False, owns_pairs=False)
        for w in (decode, prefill, lone):
            await router.add_worker(w)
        pool = router.pool
        assert pool.workers["prefill-0"].peers == {"decode-0"} and pool.workers["prefill-1"].peers == set()
        assert [w.worker_id for w in pool.candidates("prefill", needs_peer=True)] == ["prefill-0"]
        prefill.report_peers, prefill.broken = (), ("decode-0",)  # the link failed: the owner rebuilds it
        for ref in list(pool.workers.values()):
            await pool._check(ref)
        assert pool.workers["prefill-0"].peers == set()
        with pytest.raises(NoWorker):
            pool.candidates("prefill", needs_peer=True)
        await pool._health_round()  # an owner's round would start pairing the unpaired ones here
        await asyncio.sleep(0.05)
        await router.remove_worker("decode-0")
    asyncio.run(main())
    assert prefill.calls == lone.calls == decode.calls == []


def test_overloaded_admission_refuses_at_once():
    async def main():
        release = asyncio.Event()
        router = disagg(Prefill("prefill-0"), Decode("decode-0", release), max_running=1, max_waiting=0)
        stream = router.generate(req("busy", max_tokens=50))
        await stream.__anext__()
        with pytest.raises(Overloaded):
            await router.generate(req("late")).__anext__()
        release.set()
        await stream.aclose()
    asyncio.run(main())


def test_a_request_leaves_admission_before_its_last_chunk_reaches_the_client():
    """A client that has its whole answer and sends the next request at once is admitted, even
    before the first request's stream (paused by its reader at the last chunk) is closed."""
    async def main():
        router = disagg(Prefill("prefill-0"), Decode("decode-0"), max_running=1, max_waiting=0)
        for max_tokens in (1, 6):  # answered by the prefill worker alone; through a decode worker
            stream = router.generate(req(f"first-{max_tokens}", max_tokens))
            while not (await stream.__anext__()).finished:
                pass
            assert router.admission.running == 0
            following = router.generate(req(f"next-{max_tokens}"))
            assert (await following.__anext__()).token_ids == expected(1)
            await following.aclose()
            await stream.aclose()
        return router

    router = asyncio.run(main())
    assert router.admission.peak["running"] == 1  # never more dispatched at once than max_running


@pytest.mark.parametrize("exc", [
    InvalidRequest("max_tokens", "too many"), ModelNotFound("gpt-9", "tiny"), Overloaded("full"),
    StreamBroken(3, "died after 3 tokens"), NoWorker("no decode worker"), Aborted("aborted"), RuntimeError("bug"),
], ids=lambda e: type(e).__name__)
def test_both_doors_answer_from_the_one_error_table(exc):
    row = errors.answer(exc)
    http, status = api_error(exc), refusal(exc)
    assert http.status == row.http_status and status.code == grpc.StatusCode[row.grpc_code]
    assert status.outcome == row.outcome and (http.outcome or "error") == row.outcome
    assert ("Retry-After" in http.headers) == row.retry == status.retry
    if isinstance(exc, (InvalidRequest, ModelNotFound)):
        assert http.param == status.field == ("model" if isinstance(exc, ModelNotFound) else "max_tokens")


async def _drain(router, request) -> list[Chunk]:
    return [c async for c in router.generate(request)]


def test_a_stream_closed_at_its_first_token_frees_the_kv_on_both_workers():
    async def main():
        prefill, decode = Prefill("prefill-0"), Decode("decode-0")
        router = disagg(prefill, decode)
        stream = router.generate(req("gone"))
        assert (await stream.__anext__()).token_ids == expected(1)
        await stream.aclose()  # the client left before the decode worker pulled the KV
        return prefill, decode, router

    prefill, decode, router = asyncio.run(main())
    assert prefill.aborted == ["gone"] and decode.aborted == ["gone"] and not decode.started
    assert router.admission.running == 0 and not router.dispatch.active
    assert all(w.inflight == 0 and w.queued_tokens == 0 for w in router.pool.workers.values())


class FullDecode(Decode):
    """A decode pool with room for `slots` prompts at once; a slot frees when its stream ends."""

    def __init__(self, worker_id: str, slots: int):
        super().__init__(worker_id)
        self.slots, self.refused = slots, 0

    async def reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle | None:
        if self.slots == 0:
            self.refused += 1
            return None
        self.slots -= 1
        return await super().reserve(request_id, num_tokens, prefill_id)

    async def generate(self, req, first=None, handle=None):
        try:
            async for chunk in super().generate(req, first, handle):
                await asyncio.sleep(0.01)
                yield chunk
        finally:
            self.slots += 1


def test_requests_wait_in_arrival_order_for_a_full_decode_pool_instead_of_being_refused():
    decode = FullDecode("decode-0", slots=1)
    router = disagg(Prefill("prefill-0"), decode, decode_wait_s=30)

    async def main():
        return await asyncio.gather(*(_drain(router, req(f"q{i}")) for i in range(4)))

    answers = asyncio.run(main())
    assert all([t for c in chunks for t in c.token_ids] == expected(6) for chunks in answers)
    assert decode.refused > 0  # the pool was full, and the waiting requests were served anyway
    assert [rid for rid, _ in decode.reserved] == ["q0", "q1", "q2", "q3"]
    assert router.admission.running == 0 and decode.slots == 1


def test_a_decode_pool_that_stays_full_is_a_retriable_503_after_decode_wait_s():
    decode = FullDecode("decode-0", slots=0)
    router = disagg(Prefill("prefill-0"), decode, decode_wait_s=0.5)
    with pytest.raises(errors.DecodeFull, match="decode_wait_s") as caught:
        asyncio.run(_drain(router, req("late")))
    row = errors.answer(caught.value)
    assert (row.http_status, row.retry) == (503, True) and decode.refused >= 2  # it tried again while waiting
    assert router.admission.running == 0 and all(w.inflight == 0 for w in router.pool.workers.values())
