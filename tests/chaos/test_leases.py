"""Transfer holds are leases: KV reserved on a decode worker for a prefill that never arrives,
and KV the prefill worker sent there for a request whose stream never starts, are freed after
transfer.hold_timeout_s with no further traffic (the workers sweep on a timer, kv_transfer/leases.py).

A real disaggregated cluster (local Ray, gloo pair) with a 3 s hold; the holds are made by
calling the worker actors directly, as a router that died between its two calls leaves them.
"""
from __future__ import annotations

import asyncio

import pytest
import ray
from cluster_helpers import collect, pool_whole
from support import wait_for

from engine import SamplingParams
from engine.messages import GenerateRequest

HOLD_S = 3.0


@pytest.fixture(scope="module")
def cluster(torch_single_thread, ray_cluster):
    return ray_cluster(prefill=1, decode=1, transfer={"backend": "gloo", "hold_timeout_s": HOLD_S})


@pytest.mark.timeout(120)
def test_orphaned_holds_are_freed_with_no_further_traffic(cluster) -> None:
    baseline = cluster.stats()
    assert all(pool_whole(s) for s in baseline.values()), baseline
    prefill, decode = cluster.workers["prefill-0"], cluster.workers["decode-0"]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert ray.get(decode.reserve.remote("never-prefilled", 100, "prefill-0"), timeout=30)
    handle = ray.get(decode.reserve.remote("never-pulled", 100, "prefill-0"), timeout=30)
    first = ray.get(prefill.prefill.remote(GenerateRequest("never-pulled", list(range(3, 103)), params), handle),
                    timeout=30)
    assert first.kv_sent  # on its way to blocks nobody will admit
    held = cluster.stats()
    print(f"\nheld: decode reserved {held['decode-0']['reserved']} "
          f"({baseline['decode-0']['free_blocks'] - held['decode-0']['free_blocks']} blocks), "
          f"prefill pinned exports {held['prefill-0']['pinned_exports']}")
    # From here on nothing is sent to the workers but stats() (which sweeps nothing).
    def back_at_baseline():
        stats = cluster.stats()
        return stats if all(pool_whole(s) and s["free_blocks"] == baseline[w]["free_blocks"]
                            for w, s in stats.items()) else None
    freed = wait_for(back_at_baseline, HOLD_S + 30, "both holds freed")
    assert freed["decode-0"]["reserved"] == 0 and freed["prefill-0"]["pinned_exports"] == 0
    # The workers serve on: a request through the router after the sweep.
    tokens, last = asyncio.run(asyncio.wait_for(collect(cluster.router, "after", [5, 6, 7], params), 60))
    assert last.finish_reason == "length" and len(tokens) == 8
