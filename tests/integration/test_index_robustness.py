"""Redis holds data anyone with access may have written: a malformed worker lease or
index entry is skipped and logged, never fatal, and the router's health loop survives any
exception, so a dead worker is still ejected. A real redis-server; the pool over our own
WorkerClient fakes."""
from __future__ import annotations

import asyncio
import logging

import pytest
from support import wait_for
from worker_fakes import FakeWorker, router_over

from engine.block_hash import chain_hashes
from engine.messages import WorkerHealth
from router.config import IndexConfig, RouterConfig
from router.index.query import PrefixHit, PrefixIndex
from router.index.registry import WorkerRegistry, connect
from router.index.view import IndexView

PREFIX = "robust"
MODEL = "tiny@0123456789abcdef"


@pytest.fixture
def client(redis_server):
    r = connect(redis_server.url)
    yield r
    for key in r.scan_iter(f"{PREFIX}*"):
        r.delete(key)
    r.close()


def write_bad_leases(r) -> None:
    ids = f"{PREFIX}:workers"
    bad = {"no-epoch": {"role": "prefill", "started_at": "1", "info": "{}"},
           "epoch-not-a-number": {"role": "prefill", "epoch": "x", "started_at": "1", "info": "{}"},
           "info-not-json": {"role": "decode", "epoch": "3", "started_at": "1", "info": "{not json"}}
    for wid, fields in bad.items():
        r.hset(f"{PREFIX}:worker:{wid}", mapping=fields)
        r.sadd(ids, wid)


def test_malformed_leases_are_skipped_and_logged(client, caplog) -> None:
    registry = WorkerRegistry(client, prefix=PREFIX)
    registry.register("prefill-0", "prefill")
    write_bad_leases(client)
    with caplog.at_level(logging.WARNING, logger="router.index.registry"):
        assert [w.worker_id for w in registry.live_workers()] == ["prefill-0"]
    assert sum("malformed worker lease" in r.getMessage() for r in caplog.records) == 3
    registry.register("decode-0", "decode")
    assert [w.worker_id for w in registry.live_workers("decode")] == ["decode-0"]


def test_a_malformed_index_entry_ends_the_chain_not_the_query(client) -> None:
    registry = WorkerRegistry(client, prefix=PREFIX)
    epoch = registry.register("prefill-0", "prefill")
    index = PrefixIndex(client, PREFIX, MODEL)
    hashes = chain_hashes(list(range(16)), 4, MODEL)
    for h in hashes:
        client.hset(index.keys.block(h), "prefill-0", epoch * 8 + 1)
    client.delete(index.keys.block(hashes[2]))
    client.set(index.keys.block(hashes[2]), "not a hash")  # the wrong type: HMGET would fail the script
    client.hset(index.keys.block(hashes[1]), "prefill-1", "garbage")  # a field that is no number
    assert index.query(hashes, index.live_epochs())["prefill-0"] == PrefixHit(2, 2, 0, 0)


def test_a_view_over_bad_leases_refreshes_without_them(client, redis_server) -> None:
    WorkerRegistry(client, prefix=PREFIX).register("prefill-0", "prefill")
    write_bad_leases(client)
    view = IndexView(redis_server.url, IndexConfig(key_prefix=PREFIX), timeout_s=2.0)
    try:
        view.bind(MODEL, 4)
        asyncio.run(view.refresh())
        assert view.available and set(view.live) == {"prefill-0"}
    finally:
        view.close()


def test_a_lease_back_after_the_last_refresh_counts_at_the_next_query(client, redis_server, monkeypatch) -> None:
    """After a Redis restart the leases come back one by one: a refresh in between misses some,
    and until the next health round their holders' blocks must not count as none."""
    registry = WorkerRegistry(client, prefix=PREFIX)
    registry.register("prefill-0", "prefill")
    view = IndexView(redis_server.url, IndexConfig(key_prefix=PREFIX), timeout_s=2.0)
    try:
        view.bind(MODEL, 4)
        asyncio.run(view.refresh())
        assert set(view.live) == {"prefill-0"}
        epoch = registry.register("prefill-1", "prefill")  # just after the refresh, with its blocks
        prompt = list(range(17))
        for h in view.hashes(prompt, None):
            client.hset(view.index.keys.block(h), "prefill-1", epoch * 8 + 1)
        _, hits = asyncio.run(view.hits(prompt, None, ["prefill-0", "prefill-1"]))
        assert hits.get("prefill-1") == PrefixHit(4, 4, 0, 0) and hits["prefill-0"].blocks == 0
        client.delete(f"{PREFIX}:worker:prefill-1")  # its lease gone for good: one re-read per REREAD_S
        asyncio.run(view.refresh())
        monkeypatch.setattr("router.index.view.REREAD_S", 3600.0)
        view._reread_at = float("-inf")
        reads = []
        view.index.live_epochs = lambda real=view.index.live_epochs: reads.append(1) or real()
        for _ in range(20):
            _, hits = asyncio.run(view.hits(prompt, None, ["prefill-0", "prefill-1"]))
            assert "prefill-1" not in hits
        assert len(reads) == 1
    finally:
        view.close()


class Dying(FakeWorker):
    """Healthy until `die()`; then its health check says not alive."""

    alive = True

    async def health(self) -> WorkerHealth:
        return WorkerHealth(self.worker_id, self.role, alive=self.alive)


class BrokenView:
    """An index view whose every refresh raises (as reading a bad lease once did)."""

    refreshes = 0

    async def refresh(self) -> None:
        self.refreshes += 1
        raise ValueError("invalid literal for int() with base 10: 'x'")


def test_the_health_loop_survives_any_exception_and_still_ejects_a_dead_worker() -> None:
    doomed, other = Dying("mixed-0"), Dying("mixed-1")
    router = router_over(RouterConfig(health_interval_s=0.02), doomed, other)
    pool = router.pool
    view = pool.index = BrokenView()

    async def main() -> None:
        loop_task = asyncio.get_running_loop().create_task(pool._health_loop())
        try:
            await asyncio.to_thread(wait_for, lambda: view.refreshes >= 3, 10, "three failed index refreshes", 0.01)
            doomed.alive = False  # dies after three failed rounds
            await asyncio.to_thread(wait_for, lambda: not pool.workers["mixed-0"].healthy, 5,
                                    "the dead worker ejected", 0.01)
            assert not loop_task.done()
        finally:
            loop_task.cancel()
    asyncio.run(main())
    assert not pool.workers["mixed-0"].healthy and pool.workers["mixed-1"].healthy
    assert [w.worker_id for w in pool.live("mixed")] == ["mixed-1"]
