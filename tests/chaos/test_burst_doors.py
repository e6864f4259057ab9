"""Chaos: bursts at 10x capacity through the real front doors of a real `brigade serve` (`tiny`
preset, 1 prefill + 1 decode), half over HTTP and half over gRPC at once. Capacity is the
router's max_running + max_waiting, set small here.

Every request either succeeds or is refused with 429 + Retry-After / RESOURCE_EXHAUSTED + its
retry-after hint; the router's high-water marks (in /health) never pass the bounds, and the
bursts did fill them; the refusals counted by /metrics are the ones the clients saw. Figures:
refusal latency p50/p99 (target <= 50 ms) and the RSS of the serve process and the router actor
before and after the bursts that follow a warm-up (asserted below a generous growth limit).

CI runs 3 bursts after the warm-up; BRIGADE_CHAOS_FULL=1 runs 10.
"""
from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_process import Served, brigade_serve, find_process
from support import FULL, wait_for  # noqa: E402  (tests/ is on the path: tests/conftest.py)

MAX_RUNNING, MAX_WAITING = 2, 4
CAPACITY = MAX_RUNNING + MAX_WAITING
BURST = 10 * CAPACITY  # half through each door
BURSTS = 10 if FULL else 3
MAX_TOKENS = 24
PROMPT = [5, 6, 7, 8]
RSS_GROWTH_LIMIT = 50 << 20  # bytes, per process, over all bursts after the warm-up


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("burst")
    config = tmp / "cluster.yaml"
    config.write_text(f"router: {{max_running: {MAX_RUNNING}, max_waiting: {MAX_WAITING}}}\n")
    flags = ["--config", str(config), "--http-port", "0", "--grpc-port", "0", "--num-blocks", "128"]
    with brigade_serve(flags, tmp / "serve.log") as served:
        yield served


async def http_one(client: httpx.AsyncClient) -> tuple[str, float, bool]:
    """(outcome, seconds, whether a refusal carried its retry hint)."""
    start = time.perf_counter()
    resp = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                                                      "ignore_eos": True})
    seconds = time.perf_counter() - start
    if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == MAX_TOKENS:
        return "ok", seconds, True
    if resp.status_code == 429:
        return "refused", seconds, resp.headers.get("retry-after", "").isdigit()
    return f"http {resp.status_code}: {resp.text[:200]}", seconds, False


async def grpc_one(client) -> tuple[str, float, bool]:
    from brigade_client.errors import ResourceExhausted

    start = time.perf_counter()
    try:
        done = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    except ResourceExhausted as exc:
        return "refused", time.perf_counter() - start, exc.retry_after_s is not None
    except Exception as exc:  # noqa: BLE001 - anything else is a wrong answer, reported below
        return f"grpc {exc!r}"[:200], time.perf_counter() - start, False
    ok = done.finish_reason == "length" and len(done.token_ids) == MAX_TOKENS
    return ("ok" if ok else f"grpc wrong completion {done}"), time.perf_counter() - start, True


async def burst(served: Served) -> list[tuple[str, str, float, bool]]:
    """BURST concurrent requests, half per door: (door, outcome, seconds, hinted) each."""
    from brigade_client.aio import AsyncClient

    limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
    async with httpx.AsyncClient(base_url=served.http_base, timeout=120, limits=limits) as h, \
            AsyncClient(served.grpc_target, timeout=120, max_retries=0) as g:
        await g.health()  # the channel is connected before the burst
        calls = [http_one(h) if i % 2 else grpc_one(g) for i in range(BURST)]
        results = await asyncio.gather(*calls)
    return [("http" if i % 2 else "grpc", *r) for i, r in enumerate(results)]


def overloaded_total(served: Served) -> int:
    text = httpx.get(served.http_base + "/metrics", timeout=30).text
    return sum(int(float(v)) for v in re.findall(r'brigade_requests_total\{[^}]*outcome="overloaded"[^}]*\} (\S+)',
                                                 text))


def rss(served: Served) -> dict[str, int]:
    import psutil

    return {"serve": psutil.Process(served.proc.pid).memory_info().rss,
            "router": find_process(served, "ray::RouterActor").memory_info().rss}


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@pytest.mark.timeout(600)
def test_bursts_at_10x_capacity_are_bounded_refused_with_a_hint_and_memory_stays_flat(served: Served,
                                                                                     chaos_figure) -> None:
    refused_before = overloaded_total(served)
    warm_up = asyncio.run(burst(served))  # connections, threads, allocator pools
    rss_before = rss(served)
    start = time.monotonic()
    results = [r for _ in range(BURSTS) for r in asyncio.run(burst(served))]
    seconds = time.monotonic() - start
    rss_after = rss(served)
    health = httpx.get(served.http_base + "/health", timeout=30).json()
    refused_counted = overloaded_total(served) - refused_before

    outcomes = [r[1] for r in results]
    refusals = [r[2] for r in results if r[1] == "refused"]
    by_door = {door: {o: sum(1 for r in results if r[0] == door and r[1] == o) for o in ("ok", "refused")}
               for door in ("http", "grpc")}
    growth = {k: rss_after[k] - rss_before[k] for k in rss_before}
    figure = {"bursts": BURSTS, "seconds": seconds, "burst": BURST, "capacity": CAPACITY, "by_door": by_door,
              "peak": health["peak"],
              "refusal_p50_ms": 1000 * pct(refusals, 0.5), "refusal_p99_ms": 1000 * pct(refusals, 0.99),
              "rss_before_mb": {k: v / 2**20 for k, v in rss_before.items()},
              "rss_growth_mb": {k: v / 2**20 for k, v in growth.items()}}
    print(f"\nburst at 10x: {json.dumps(figure)}")
    chaos_figure("burst_doors", {"refusal_p99_ms": figure["refusal_p99_ms"]}, {"refusal_p99_ms": "<= 50"}, **figure)

    wrong = [r for r in results if r[1] not in ("ok", "refused")]
    assert not wrong, wrong[:5]
    assert all(r[3] for r in results if r[1] == "refused"), "a refusal without its retry-after hint"
    assert health["peak"]["running"] <= MAX_RUNNING and health["peak"]["waiting"] <= MAX_WAITING, health
    assert health["peak"] == {"running": MAX_RUNNING, "waiting": MAX_WAITING}, "the bursts never filled the queue"
    assert by_door["http"]["refused"] and by_door["grpc"]["refused"] and outcomes.count("ok") >= MAX_RUNNING
    # /metrics counts every refusal the clients saw (the warm-up's too), no more.
    assert refused_counted == len(refusals) + sum(r[1] == "refused" for r in warm_up)
    for name, grown in growth.items():
        assert grown < RSS_GROWTH_LIMIT, f"{name} RSS grew {grown / 2**20:.1f} MB over {BURSTS} bursts"


async def probe_full_queue(served: Served, probes: int) -> tuple[list, dict]:
    """Fill the router (CAPACITY long streams), then send `probes` requests one at a time per
    door: the refusal latency without a burst's own crowding. The fillers are cancelled after."""
    from brigade_client.aio import AsyncClient

    async with httpx.AsyncClient(base_url=served.http_base, timeout=120) as h, \
            AsyncClient(served.grpc_target, timeout=300, max_retries=0) as g:
        async def filler() -> None:
            async for _ in g.stream(PROMPT, max_tokens=900, temperature=0, ignore_eos=True):
                pass

        fillers = [asyncio.create_task(filler()) for _ in range(CAPACITY)]
        await asyncio.to_thread(wait_for, lambda: holding(served, MAX_RUNNING, MAX_WAITING), 60,
                                "the fillers holding the router full", 0.05)
        results = []
        for i in range(2 * probes):
            results.append(("http", *await http_one(h)) if i % 2 else ("grpc", *await grpc_one(g)))
        for f in fillers:
            f.cancel()
        await asyncio.gather(*fillers, return_exceptions=True)
        health = await asyncio.to_thread(wait_for, lambda: holding(served, 0, 0), 30, "the router idle", 0.05)
    return results, health


def holding(served: Served, running: int, waiting: int) -> dict | None:
    """/health once the router holds exactly `running` and `waiting` requests."""
    health = httpx.get(f"{served.http_base}/health", timeout=30).json()
    return health if (health["running"], health["waiting"]) == (running, waiting) else None


@pytest.mark.timeout(300)
def test_with_the_queue_full_a_request_is_refused_at_once(served: Served, chaos_figure) -> None:
    results, health = asyncio.run(probe_full_queue(served, probes=50 if FULL else 10))
    refusals = {door: [r[2] for r in results if r[0] == door and r[1] == "refused"] for door in ("http", "grpc")}
    figure = {door: {"refused": len(v), "p50_ms": 1000 * pct(v, 0.5), "p99_ms": 1000 * pct(v, 0.99)}
              for door, v in refusals.items() if v}
    print(f"\nrefusal with the queue full: {json.dumps(figure)}")
    chaos_figure("refusal_queue_full", {f"{d}_p99_ms": f["p99_ms"] for d, f in figure.items()},
                 {f"{d}_p99_ms": "<= 50" for d in figure}, **figure)
    assert all(r[1] in ("ok", "refused") for r in results), results
    assert all(r[3] for r in results if r[1] == "refused"), "a refusal without its retry-after hint"
    assert refusals["http"] and refusals["grpc"], results  # the fillers held the queue full meanwhile
    assert health["peak"]["running"] <= MAX_RUNNING and health["peak"]["waiting"] <= MAX_WAITING, health
