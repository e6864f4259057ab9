"""Chaos: SIGKILL one rank (not the leader) of a TP=2 decode group while streams run on it
(real local Ray, `tiny` preset, 1 prefill worker + 2 decode groups of two ranks over real gloo
groups, collectives bounded by parallel.timeout_s = 10 s, the supervisor running).

The survivors must fail within the timeout rather than wait on the dead rank forever: the
leader reports itself down and the router stops routing to the group; the supervisor tears
the group down as a unit and starts a fresh one, which serves the fault-free tokens. No
stream may hang or fail: the leader's engine dies with the group (EngineDied), which the
router treats like a dead worker, so each stream ends completed with the fault-free tokens
(on the other group, or migrated there) or retriable with the count of tokens it got.
The figure: seconds from the kill until the leader is down, until the group is replaced,
until the new group has served a request; the streams' outcomes.
"""
from __future__ import annotations

import asyncio
import random
import time

import pytest
import ray
from support import wait_for
from test_decode_kill import VOCAB, wait_pools_whole

from cluster.config import SupervisorConfig
from cluster.supervisor import Supervisor
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.messages import GenerateRequest
from router.errors import StreamBroken

pytestmark = pytest.mark.usefixtures("torch_single_thread")

STREAMS = 4
KILL_AFTER_CHUNKS = 3
TIMEOUT_S = 10.0  # parallel.timeout_s: every collective of the group is bounded by it
PARAMS = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
STREAM_DEADLINE_S = 90.0  # a stream still open then is hung


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    return ray_cluster(num_cpus=3, prefill=1, decode=2, parallel={"decode_tp": 2, "timeout_s": TIMEOUT_S})


def wait_until(what: str, check, timeout_s: float) -> float:
    """wait_for(check), then the monotonic time it became true."""
    wait_for(check, timeout_s, what, interval_s=0.05)
    return time.monotonic()


def alive(handle) -> bool:
    try:
        return ray.get(handle.health.remote(), timeout=5).alive
    except Exception:  # a dead leader counts as down too
        return False


async def stream(router, rid: str, prompt: list[int], ready: asyncio.Event) -> tuple[list[int], object]:
    """(tokens, the last chunk, or the exception that ended the stream, or "hung")."""
    tokens, chunks = [], 0

    async def read():
        nonlocal chunks
        async for ref in router.generate.remote(GenerateRequest(rid, prompt, PARAMS)):
            chunk = await ref
            tokens.extend(chunk.token_ids)
            chunks += 1
            if chunks == KILL_AFTER_CHUNKS:
                ready.set()
            if chunk.finished:
                return chunk
        raise AssertionError(f"{rid}: the stream ended without a last chunk")

    try:
        return tokens, await asyncio.wait_for(read(), STREAM_DEADLINE_S)
    except TimeoutError:
        return tokens, "hung"
    except Exception as exc:  # StreamBroken, or whichever error Ray wraps the group's failure in
        return tokens, exc
    finally:
        ready.set()


@pytest.mark.timeout(300)
def test_killing_one_rank_fails_its_group_fast_and_the_supervisor_replaces_it(cluster, chaos_figure):
    rng = random.Random(5)
    batch = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(8, 60))] for _ in range(STREAMS)]
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=512)))
    reference = [o.token_ids for o in engine.generate(batch, [PARAMS] * STREAMS)]
    supervisor = Supervisor(cluster, SupervisorConfig(grace_s=0.5, interval_s=0.2)).start()
    try:
        killed, times, results, again = asyncio.run(kill_a_rank(cluster, batch))
    finally:
        supervisor.stop()

    outcomes = {"identical": 0, "migrated": 0, "retriable": 0, "failed": 0, "hung": 0}
    for i, (tokens, last) in enumerate(results):
        if last == "hung":
            outcomes["hung"] += 1
        elif isinstance(last, StreamBroken):
            outcomes["retriable"] += 1
            assert last.tokens_sent == len(tokens) and tokens == reference[i][:len(tokens)], f"stream {i}"
        elif isinstance(last, Exception):  # must not happen: a broken group's streams migrate
            outcomes["failed"] += 1
            assert tokens == reference[i][:len(tokens)], f"stream {i}"
        else:
            assert tokens == reference[i], f"stream {i}: tokens differ from the fault-free run"
            assert last.finish_reason == "length" and last.decode_worker != killed
            outcomes["identical"] += 1
            outcomes["migrated"] += last.timing.migrations > 0
    affected = outcomes["migrated"] + outcomes["retriable"] + outcomes["failed"] + outcomes["hung"]
    figure = {"leader_down_s": times["down"], "router_ejects_s": times["ejected"], "replaced_s": times["replaced"],
              "serves_again_s": times["serves"], "timeout_s": TIMEOUT_S, "streams": STREAMS,
              "on_the_killed_group": affected, **outcomes}
    print(f"\nTP=2 rank kill of {killed}: {figure}")
    chaos_figure("tp_rank_kill", {"hung": outcomes["hung"]}, {"hung": "== 0"}, **figure)
    assert outcomes["hung"] == outcomes["failed"] == 0
    assert affected >= 1, "no stream ran on the killed group"
    for i, (tokens, last) in enumerate(again):  # after the replacement: both groups serve the fault-free tokens
        assert not isinstance(last, (str, Exception)) and tokens == reference[i], f"after the replacement: {i}"
    wait_pools_whole(cluster)


async def kill_a_rank(cluster, batch: list[list[int]]):
    readies = [asyncio.Event() for _ in batch]
    tasks = [asyncio.create_task(stream(cluster.router, f"rank-kill-{i}", p, r))
             for i, (p, r) in enumerate(zip(batch, readies))]
    await asyncio.gather(*(r.wait() for r in readies))
    workers = (await cluster.router.status.remote())["workers"]
    killed = max((w for w in workers if w.startswith("decode-")), key=lambda w: workers[w]["inflight"])
    leader = cluster.workers[killed]
    ray.kill(cluster.groups[killed].ranks[0])  # a follower: the leader lives and must notice by itself
    start = time.monotonic()
    since = lambda t: round(t - start, 2)  # noqa: E731

    def ejected() -> bool:
        w = ray.get(cluster.router.status.remote())["workers"].get(killed)
        return w is None or not w["healthy"]

    times = {"down": since(await asyncio.to_thread(wait_until, "leader down", lambda: not alive(leader), 60)),
             "ejected": since(await asyncio.to_thread(wait_until, "router ejects", ejected, 30))}
    results = await asyncio.gather(*tasks)
    times["replaced"] = since(await asyncio.to_thread(
        wait_until, "group replaced", lambda: killed not in cluster.workers and len(cluster.workers) == 3, 120))
    new = next(w for w in cluster.workers if w.startswith("decode-") and w not in workers)
    assert killed not in cluster.groups and len(cluster.groups[new].ranks) == 1
    # Two at once: the least-loaded pick sends one to each decode group, so the new one serves.
    again = await asyncio.gather(*(stream(cluster.router, f"after-{i}", batch[i], asyncio.Event()) for i in (0, 1)))
    times["serves"] = since(time.monotonic())
    assert any(getattr(last, "decode_worker", None) == new for _, last in again), again
    return killed, times, results, again
