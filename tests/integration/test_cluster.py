"""The cluster end to end: real Ray (local), real gloo pairs, the `tiny` preset.

Tokens must equal the single-process engine's (greedy), whatever worker served them, and no
worker may keep a block once its requests are done, aborted or recomputed.

Cost on two shared cores: worker start-up dominates, so the module starts Ray once and only
two clusters. The colocated one lives inside its test. The disaggregated one is module-scoped
and grows in file order: 1 prefill + 1 decode (tokens, abort, corrupted payload), then a
prefill worker is added, then a decode worker (tokens on 2 + 2), then a decode worker is
killed. Each test that needs a topology adds what is missing, so any one runs alone too.
The first tests drive the plain worker classes in this process, without Ray.
"""
from __future__ import annotations

import asyncio
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
from cluster_helpers import BS, NUM_BLOCKS, PARAMS, PROMPTS, VOCAB, collect, disaggregate, pool_whole
from support import wait_for

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, LLMEngine, Role, SamplingParams
from engine.messages import Aborted, Chunk, GenerateRequest
from kv_transfer import KVTransferError, LayoutMismatch, RefuseReason, TransferConfig, new_ticket
from kv_transfer.handoff import HandoffState
from prefill_worker import PrefillWorker

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TRANSFER = TransferConfig(backend="gloo", timeout_s=20.0, connect_timeout_s=30.0)


# Prefilled in two steps of 2048 tokens: long enough for an abort to land while it prefills.
LONG_PROMPT = [random.Random(1).randrange(3, VOCAB) for _ in range(3000)]


@pytest.fixture(scope="module")
def reference() -> tuple[list[list[int]], int]:
    """(each workload request's tokens from one mixed engine in this process, KV bytes per block)."""
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    outs = engine.generate(PROMPTS, PARAMS)
    kv = engine.runner.kv_cache  # (2, L, num_blocks, bs, Hkv, hd)
    return [o.token_ids for o in outs], kv[:, :, 0].numel() * kv.element_size()


# --- plain worker classes in this process (no Ray) ----------------------------------------------

@pytest.fixture(scope="module")
def plain_workers():
    """A prefill worker paired over real gloo with two decode workers: one like it, one whose
    KV blocks hold 8 tokens instead of 16 (a different layout)."""
    cfg = EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=256))
    prefill = PrefillWorker("prefill-p", cfg, TRANSFER)
    decoding = cfg.model_copy(update={"role": Role.DECODE})  # as cluster.config.worker_config gives it
    decode = DecodeWorker("decode-p", decoding, TRANSFER)
    odd = DecodeWorker("decode-odd", decoding.model_copy(update={"cache": CacheConfig(num_blocks=256, block_size=8)}),
                       TRANSFER)
    with ThreadPoolExecutor(1) as pool:
        for d in (decode, odd):
            ticket = new_ticket()  # what the router hands both sides
            accepted = pool.submit(d.accept, ticket)
            prefill.connect(d.worker_id, d.address, ticket)
            assert accepted.result(timeout=30) == "prefill-p"
    yield prefill, decode, odd
    for w in (prefill, decode, odd):
        w.close()


@pytest.mark.timeout(120)
def test_plain_workers_pull_and_start_give_the_mixed_engines_tokens(plain_workers, reference):
    prefill, decode, _ = plain_workers
    expected, block_bytes = reference
    for i in (0, 2, 3, 5, 7, 11):  # prompts of 1, 15, 41 (shared prefix), 31, 64 and 203 (shared) tokens
        tokens, timing = disaggregate(prefill, decode, f"plain-{i}", PROMPTS[i], PARAMS[i])
        assert tokens == expected[i], f"request {i}"
        assert timing.transfer_bytes == -(-len(PROMPTS[i]) // BS) * block_bytes and not timing.recomputed
    assert pool_whole(prefill.stats()) and pool_whole(decode.stats())
    assert prefill.channels["decode-p"].stats.payloads == decode.channels["prefill-p"].stats.payloads == 6


@pytest.mark.timeout(120)
def test_plain_workers_refuse_a_layout_mismatch_before_any_payload(plain_workers, reference):
    prefill, decode, odd = plain_workers
    prompt, params = PROMPTS[6], PARAMS[6]
    req = GenerateRequest("odd-1", prompt, params)
    handle = odd.reserve("odd-1", len(prompt), "prefill-p")
    assert handle is not None
    assert prefill.prefill(req, handle).result(timeout=30).kv_sent
    with pytest.raises(LayoutMismatch, match="SHAPE") as mismatch:
        odd.kv.wait(handle, req)
    assert mismatch.value.reason is RefuseReason.SHAPE
    rx = odd.channels["prefill-p"].stats
    assert (rx.requests, rx.refused, rx.payloads, rx.payload_bytes) == (1, 1, 0, 0)
    prefill.kv.senders["decode-odd"].submit(lambda: None).result(timeout=30)  # the send has returned
    tx = prefill.channels["decode-odd"].stats
    assert (tx.requests, tx.refused, tx.accepted, tx.payloads) == (1, 1, 0, 0)
    assert odd.stats()["reserved"] == 1  # the caller decides: abort (or recompute)
    odd.abort("odd-1")
    assert pool_whole(odd.stats()) and pool_whole(prefill.stats())

    tokens, _ = disaggregate(prefill, decode, "after-odd", prompt, params)  # other pairs unaffected
    assert tokens == reference[0][6]


@pytest.mark.timeout(60)
def test_plain_prefill_worker_answers_a_prefill_aborted_before_its_first_token(plain_workers):
    prefill, _, _ = plain_workers
    result = prefill.prefill(GenerateRequest("early", LONG_PROMPT, SamplingParams(max_tokens=4)))
    prefill.abort("early")
    with pytest.raises(Aborted, match="'early'"):
        result.result(timeout=10)  # answered, not left waiting forever
    assert pool_whole(prefill.stats()) and not prefill.pending


@pytest.mark.timeout(60)
def test_kv_nobody_collects_is_freed_after_the_hold_timeout(plain_workers):
    """The router died after the prefill (its KV already written into the decode worker's blocks,
    never admitted) and after a reservation whose prefill never came: both are freed."""
    prefill, decode, _ = plain_workers
    prompt, params = PROMPTS[5], PARAMS[5]
    handle = decode.reserve("orphan", len(prompt), prefill.worker_id)
    assert prefill.prefill(GenerateRequest("orphan", prompt, params), handle).result(timeout=30).kv_sent
    assert decode.reserve("orphan-r", len(prompt), prefill.worker_id)
    wait_for(lambda: decode.kv.handoffs["orphan"].state is HandoffState.WRITTEN, 10.0, "the KV written")
    assert pool_whole(prefill.stats()) and decode.stats()["reserved"] == 2  # nothing is left on the prefill side
    # Pretend hold_timeout_s has passed: the worker's lease sweeper (each second, with no further
    # call; tests/chaos/test_leases.py over Ray) frees both.
    for rid in ("orphan", "orphan-r"):
        decode.kv.handoffs[rid].reserved_at -= 10_000
    wait_for(lambda: pool_whole(decode.stats()), 10.0, "holds swept")
    assert "orphan" not in decode.kv.handoffs and "orphan-r" not in decode.kv.handoffs
    with pytest.raises(KVTransferError, match="aborted or stale"):
        decode.kv.wait(handle, GenerateRequest("orphan", prompt, params))  # nothing left to admit


@pytest.mark.timeout(60)
def test_a_cancel_racing_the_recompute_of_a_failed_pull_leaves_nothing_running(plain_workers):
    """The transfer fails (the prefill worker sent no KV) and the decode worker recomputes;
    cancel() lands just then and its abort runs before the recomputed request is added (a CI run
    of tests/chaos/test_cancel_leaks.py caught it). The stream ends "abort" and nothing runs on
    unread: backpressure would hold it, and its blocks, for good."""
    prefill, decode, _ = plain_workers
    rid, prompt = "race", PROMPTS[5]
    req = GenerateRequest(rid, prompt, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    first = prefill.prefill(req).result(timeout=30)  # no handle: no KV goes anywhere
    assert not first.kv_sent
    handle = decode.reserve(rid, len(prompt), prefill.worker_id)
    assert handle is not None
    add = decode.generate_local

    def cancelled_first(r, sink):
        stream = decode.streams[rid]
        stream.aborted = True  # all of cancel(), before the add
        stream.end_aborted(rid, decode.abort(rid))
        return add(r, sink)

    async def run() -> list[Chunk]:
        chunks = [c async for c in decode.stream(req, first, handle)]
        # The loop lives on, as a worker's does (a closed one would fail the stream's sink).
        await asyncio.to_thread(wait_for, lambda: pool_whole(decode.stats()) and not decode.stats()["running"],
                                10.0, lambda: f"the decode pool whole, nothing running: {decode.stats()}")
        return chunks

    decode.generate_local = cancelled_first
    try:
        chunks = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        del decode.generate_local
        prefill.abort(rid)
    assert chunks[-1].finished and chunks[-1].finish_reason == "abort"
    assert pool_whole(prefill.stats())


# --- Ray clusters -------------------------------------------------------------------------------

def run_requests(cluster, ids: list[int], tag: str, timeout_s: float = 90.0) -> list[tuple[list[int], Chunk]]:
    """Workload requests `ids`, all at once, as `<tag>-<id>`; results in order."""
    async def main():
        return await asyncio.gather(*(collect(cluster.router, f"{tag}-{i}", PROMPTS[i], PARAMS[i]) for i in ids))
    return asyncio.run(asyncio.wait_for(main(), timeout_s))


def check_response(i: int, tokens: list[int], last: Chunk, reference, *, disaggregated: bool = True) -> None:
    expected, block_bytes = reference
    assert tokens == expected[i], f"request {i}"
    assert last.finished and last.finish_reason == "length"
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPTS[i]), PARAMS[i].max_tokens)
    t = last.timing
    assert t is not None and t.queue_s >= 0 and 0 < t.ttft_s <= t.total_s and not t.recomputed
    assert last.decode_worker is not None
    if disaggregated:
        assert last.prefill_worker is not None and t.prefill_s > 0 and t.transfer_s > 0
        assert t.transfer_bytes == -(-len(PROMPTS[i]) // BS) * block_bytes
    else:
        assert last.prefill_worker is None and t.transfer_bytes == 0


def abort_mid_stream(cluster, rid: str, after_chunks: int = 3) -> tuple[list[int], Chunk]:
    """A long request aborted through the router once `after_chunks` chunks arrived; it must
    end with finish_reason "abort" long before max_tokens. (tokens, last chunk)"""
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        tokens, chunks, last = [], 0, None
        async for ref in cluster.router.generate.remote(GenerateRequest(rid, PROMPTS[10], params)):
            last = await ref
            tokens += last.token_ids
            chunks += 1
            if chunks == after_chunks:
                assert await cluster.router.abort.remote(rid)
        return tokens, last

    tokens, last = asyncio.run(asyncio.wait_for(main(), 30))
    assert last.finished and last.finish_reason == "abort"
    assert after_chunks <= len(tokens) < params.max_tokens
    return tokens, last


def ray_get(ref, timeout_s: float = 30.0):
    return ray.get(ref, timeout=timeout_s)




def wait_pools_whole(cluster, timeout_s: float = 10.0) -> dict:
    """Every live worker's pool whole (dead ones report an error and are skipped)."""
    def whole():
        stats = {k: s for k, s in cluster.stats().items() if "error" not in s}
        return stats if all(pool_whole(s) for s in stats.values()) else None
    return wait_for(whole, timeout_s, "every pool whole")


def ensure_workers(cluster, role: str, count: int) -> None:
    while sum(w.startswith(role + "-") for w in cluster.workers) < count:
        cluster.add_worker(role)


@pytest.mark.timeout(180)
def test_colocated_cluster_gives_the_same_tokens_and_aborts_cleanly(ray_cluster, reference):
    cluster = ray_cluster(mode="colocated", decode=2)
    try:
        assert sorted(cluster.workers) == ["mixed-0", "mixed-1"]
        ids = list(range(0, len(PROMPTS), 2))
        results = run_requests(cluster, ids, "colo")
        for i, (tokens, last) in zip(ids, results):
            check_response(i, tokens, last, reference, disaggregated=False)
        assert {last.decode_worker for _, last in results} == {"mixed-0", "mixed-1"}
        wait_pools_whole(cluster)
        abort_mid_stream(cluster, "colo-abort")
        wait_pools_whole(cluster)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    """The disaggregated cluster, started as 1 prefill + 1 decode; tests below grow it."""
    return ray_cluster(prefill=1, decode=1)


@pytest.mark.timeout(180)
def test_one_prefill_one_decode_give_the_engines_tokens(cluster, reference):
    assert sorted(cluster.workers) == ["decode-0", "prefill-0"]
    results = run_requests(cluster, list(range(len(PROMPTS))), "p1d1")
    for i, (tokens, last) in enumerate(results):
        check_response(i, tokens, last, reference)
        assert (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
    wait_pools_whole(cluster)


@pytest.mark.timeout(120)
def test_a_second_cluster_in_the_same_ray_is_refused_clearly_and_leaves_nothing_behind(cluster, ray_cluster,
                                                                                       reference, monkeypatch):
    from cluster import launch

    made = []
    real_init = launch.Cluster.__post_init__
    monkeypatch.setattr(launch.Cluster, "__post_init__", lambda self: (made.append(self), real_init(self))[1])
    named = sorted(ray.util.list_named_actors())
    with pytest.raises(launch.WorkerNameTaken, match="'prefill-0' already runs in this Ray cluster"):
        ray_cluster(prefill=1, decode=1)  # its worker ids are the running cluster's
    with pytest.raises(ray.exceptions.RayActorError):  # the refused cluster's router was stopped
        ray_get(made[0].router.status.remote())
    assert sorted(ray.util.list_named_actors()) == named
    tokens, last = run_requests(cluster, [0], "after-refusal")[0]  # the running one is untouched
    check_response(0, tokens, last, reference)


@pytest.mark.timeout(120)
def test_abort_mid_stream_ends_the_stream_and_frees_both_sides(cluster):
    tokens, last = abort_mid_stream(cluster, "abort-me")
    assert last.timing is not None and (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
    wait_pools_whole(cluster)
    status = ray_get(cluster.router.status.remote())
    assert status["running"] == 0 and all(w["inflight"] == 0 for w in status["workers"].values())


@pytest.mark.timeout(60)
def test_abort_while_prefilling_ends_the_stream_and_frees_both_sides(cluster):
    """The abort is sent 50 ms after the router took the request: then (on this CPU) the prefill
    worker is in the first of its two ~0.3 s steps for LONG_PROMPT. Whenever it lands before
    decoding starts, the stream ends with an empty "abort" chunk."""
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)

    async def main():
        stream = cluster.router.generate.remote(GenerateRequest("abort-early", LONG_PROMPT, params))
        await asyncio.to_thread(wait_for, lambda: ray.get(cluster.router.status.remote())["running"], 30,
                                "the router taking the request", 0.001)
        await asyncio.sleep(0.05)
        assert await cluster.router.abort.remote("abort-early")
        tokens, last = [], None
        async for ref in stream:
            last = await ref
            tokens += last.token_ids
        return tokens, last

    tokens, last = asyncio.run(asyncio.wait_for(main(), 30))
    assert last.finished and last.finish_reason == "abort" and tokens == []
    wait_pools_whole(cluster)
    status = ray_get(cluster.router.status.remote())
    assert status["running"] == 0 and all(w["inflight"] == 0 for w in status["workers"].values())


@pytest.mark.timeout(120)
def test_corrupted_payload_is_recomputed_and_the_channel_stays_usable(cluster, reference):
    ray_get(cluster.workers["prefill-0"].corrupt_next_payload.remote("decode-0"))
    [(tokens, last)] = run_requests(cluster, [9], "corrupt")
    assert tokens == reference[0][9] and last.finish_reason == "length"
    assert last.timing.recomputed and last.decode_worker == "decode-0"

    [(tokens, last)] = run_requests(cluster, [8], "after-corrupt")
    check_response(8, tokens, last, reference)  # transferred normally: recomputed False
    wait_pools_whole(cluster)


@pytest.mark.timeout(180)
def test_a_prefill_worker_added_while_running_serves_requests(cluster, reference):
    before = sum(w.startswith("prefill-") for w in cluster.workers)
    new = cluster.add_worker("prefill")
    assert new == f"prefill-{before}"
    assert ray_get(cluster.router.status.remote())["workers"][new] == {"role": "prefill", "healthy": True,
                                                                      "inflight": 0, "queued_tokens": 0}
    assert cluster.stats()[new]["channels"] == sorted(w for w in cluster.workers if w.startswith("decode-"))
    served = []
    for attempt in range(3):  # concurrent requests spread over the least-loaded prefill workers
        ids = [4 * attempt + k for k in range(4)]
        for i, (tokens, last) in zip(ids, run_requests(cluster, ids, f"added-{attempt}")):
            check_response(i, tokens, last, reference)
            served.append(last.prefill_worker)
        if new in served:
            break
    assert new in served, served
    wait_pools_whole(cluster)


@pytest.mark.timeout(180)
def test_two_prefill_two_decode_give_the_engines_tokens_on_every_worker(cluster, reference):
    ensure_workers(cluster, "prefill", 2)
    ensure_workers(cluster, "decode", 2)
    results = run_requests(cluster, list(range(len(PROMPTS))), "p2d2")
    for i, (tokens, last) in enumerate(results):
        check_response(i, tokens, last, reference)
    assert {last.prefill_worker for _, last in results} == {"prefill-0", "prefill-1"}
    assert {last.decode_worker for _, last in results} == {"decode-0", "decode-1"}
    wait_pools_whole(cluster)


@pytest.mark.timeout(120)
def test_a_killed_decode_worker_turns_unhealthy_and_requests_go_elsewhere(cluster, reference):
    """Last on this cluster: it destroys a worker."""
    ensure_workers(cluster, "decode", 2)
    ray.kill(cluster.workers["decode-1"])
    start = time.monotonic()

    def dead() -> bool:
        try:
            ray_get(cluster.workers["decode-1"].health.remote(), 5.0)
            return False
        except Exception:
            return True

    wait_for(dead, 10.0, "decode-1 dead")
    # Right away, likely before the router's next health check: a reserve that fails on the
    # dead worker marks it unhealthy and the request goes to the other one.
    for i, (tokens, last) in zip([0, 2], run_requests(cluster, [0, 2], "at-kill")):
        check_response(i, tokens, last, reference)
        assert last.decode_worker == "decode-0"
    wait_for(lambda: not ray_get(cluster.router.status.remote())["workers"]["decode-1"]["healthy"], 10.0,
             "decode-1 unhealthy")
    assert time.monotonic() - start < 10.0
    workers = ray_get(cluster.router.status.remote())["workers"]
    assert all(w["healthy"] for wid, w in workers.items() if wid != "decode-1")
    ids = [1, 3, 8, 11]
    for i, (tokens, last) in zip(ids, run_requests(cluster, ids, "after-kill")):
        check_response(i, tokens, last, reference)
        assert last.decode_worker == "decode-0"
    assert "error" in cluster.stats()["decode-1"]
    wait_pools_whole(cluster)

