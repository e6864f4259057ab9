"""Admission under a burst at 10x capacity: the router's waiting queue stays within its bounds
(requests and prompt tokens) and the excess is refused at once with Overloaded, which both doors
answer as 429 / RESOURCE_EXHAUSTED with a retry-after hint (tests/test_http_api.py, test_grpc_door.py).

The Router runs over a plain async fake of WorkerClient, which holds every stream until
released, so the burst meets full slots.
"""
from __future__ import annotations

import asyncio
import time

from worker_fakes import FakeWorker

from engine.messages import Chunk, GenerateRequest
from router.config import RouterConfig
from router.errors import Overloaded
from router.router import Router


class HeldWorker(FakeWorker):
    """A mixed worker whose streams all wait for `release`; one token, then finished."""

    def __init__(self):
        super().__init__("w0", "mixed")
        self.release = asyncio.Event()

    async def generate(self, req: GenerateRequest, first=None, prefill=None):
        await self.release.wait()
        yield Chunk(req.request_id, [7], "x", True, "length")


async def _burst(cfg: RouterConfig, n: int, prompt_len: int) -> dict:
    router = Router(cfg, colocated=True)
    worker = HeldWorker()
    await router.add_worker(worker)
    peak = {"waiting": 0, "waiting_tokens": 0}
    refusals: list[float] = []

    async def one(i: int) -> str:
        start = time.perf_counter()
        try:
            async for chunk in router.generate(GenerateRequest(f"r{i}", [1] * prompt_len)):
                last = chunk
            return last.finish_reason
        except Overloaded:
            refusals.append(time.perf_counter() - start)
            return "refused"
        finally:
            peak["waiting"] = max(peak["waiting"], router.admission.waiting)
            peak["waiting_tokens"] = max(peak["waiting_tokens"], router.admission.waiting_tokens)

    tasks = [asyncio.create_task(one(i)) for i in range(n)]
    for _ in range(5):  # let every request reach admission
        await asyncio.sleep(0)
    peak = {"waiting": max(peak["waiting"], router.admission.waiting),
            "waiting_tokens": max(peak["waiting_tokens"], router.admission.waiting_tokens)}
    refused_before_release = len(refusals)
    worker.release.set()
    outcomes = await asyncio.gather(*tasks)
    router.pool._health_task.cancel()
    return {"outcomes": outcomes, "peak": peak, "refusals": refusals, "refused_before_release": refused_before_release,
            "router": router}


def test_a_burst_at_10x_capacity_is_bounded_by_prompt_tokens() -> None:
    # Capacity: 4 running + 1,000 waiting prompt tokens (10 prompts of 100); the burst is 140.
    cfg = RouterConfig(max_running=4, max_waiting=1000, max_waiting_tokens=1000, health_interval_s=60)
    r = asyncio.run(_burst(cfg, n=140, prompt_len=100))
    served = r["outcomes"].count("length")
    refused = r["outcomes"].count("refused")
    lat = sorted(r["refusals"])
    print(f"\nburst of 140 at capacity 14: served {served}, refused {refused}, peak waiting "
          f"{r['peak']['waiting']} requests / {r['peak']['waiting_tokens']} tokens; refusal latency "
          f"p50 {lat[len(lat) // 2] * 1e6:.0f} us, max {lat[-1] * 1e6:.0f} us")
    assert r["peak"]["waiting_tokens"] <= 1000 and r["peak"]["waiting"] == 10
    assert served == 14 and refused == 126
    assert r["refused_before_release"] == 126  # refused while the workers were still busy, not after
    admission = r["router"].admission
    assert admission.waiting == admission.waiting_tokens == admission.running == 0


def test_the_request_bound_still_holds_with_short_prompts() -> None:
    cfg = RouterConfig(max_running=2, max_waiting=5, max_waiting_tokens=1_000_000, health_interval_s=60)
    r = asyncio.run(_burst(cfg, n=70, prompt_len=3))
    assert r["peak"]["waiting"] == 5 and r["outcomes"].count("length") == 7
    assert r["outcomes"].count("refused") == 63


def test_a_prompt_alone_over_the_token_bound_waits_only_when_a_slot_is_free() -> None:
    """The bound is on waiting tokens: an idle router still runs a long prompt at once."""
    cfg = RouterConfig(max_running=1, max_waiting=10, max_waiting_tokens=50, health_interval_s=60)
    r = asyncio.run(_burst(cfg, n=3, prompt_len=80))
    assert r["outcomes"] == ["length", "refused", "refused"]
