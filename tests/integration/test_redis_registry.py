"""EmbeddedRedis and WorkerRegistry against a real redis-server (installed by `make system-deps`)."""
from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis
from support import wait_for

from cluster import redis_server
from cluster.redis_server import EmbeddedRedis, RedisServerError
from router.index.registry import Heartbeat, RegistryError, WorkerRegistry

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"  # tests share one server, never each other's keys




def test_embedded_redis_answers_on_loopback_only(server: EmbeddedRedis) -> None:
    assert server.url == f"redis://:{server.password}@127.0.0.1:{server.port}/0"
    assert redis.Redis.from_url(server.url).ping()
    listening = [c for c in psutil.Process(server.pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert listening and {c.laddr.ip for c in listening} == {"127.0.0.1"}
    assert {c.laddr.port for c in listening} == {server.port}
    client = redis.Redis.from_url(server.url, decode_responses=True)
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}


def test_stop_leaves_no_process_or_files() -> None:
    srv = EmbeddedRedis().start()
    pid, workdir = srv.pid, Path(srv.proc.args[1]).parent
    assert workdir.is_dir()
    srv.stop()
    srv.stop()  # idempotent
    assert not psutil.pid_exists(pid)  # reaped, not a zombie
    assert not workdir.exists()


def test_missing_binary_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    monkeypatch.setattr(redis_server, "FALLBACK_PATHS", ("/nonexistent/redis-server",))
    with pytest.raises(RedisServerError, match=r"apt-get install redis-server.*--redis-url"):
        EmbeddedRedis()


def test_failed_start_names_binary_and_output(tmp_path: Path) -> None:
    fake = tmp_path / "fake-redis-server"
    fake.write_text("#!/bin/sh\necho 'bad config line' >&2\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RedisServerError, match=r"fake-redis-server.*exited with status 3(.|\n)*bad config line"):
        EmbeddedRedis(binary=str(fake)).start()


def test_heartbeat_keeps_lease_and_expiry_drops_it(server: EmbeddedRedis, prefix: str) -> None:
    reg = WorkerRegistry(server.url, prefix=prefix, ttl_s=1.0)
    epoch = reg.register("p0", "prefill", {"address": "10.0.0.1:7000"})
    reg.register("quiet", "prefill")  # never heartbeats
    with_beat = Heartbeat(reg, "p0", epoch).start()
    try:
        time.sleep(2.0)  # twice the TTL
        live = reg.live_workers()
        assert [w.worker_id for w in live] == ["p0"]
        assert live[0].info == {"address": "10.0.0.1:7000"} and live[0].epoch == epoch
        assert not with_beat.lost.is_set()
    finally:
        with_beat.stop()
    assert wait_for(lambda: reg.live_workers() == [], timeout_s=3.0)
    assert reg.redis.smembers(f"{prefix}:workers") == set()  # expired ids are pruned
    assert not reg.heartbeat("p0", epoch)  # an expired lease is not revived by a late beat


def test_epoch_changes_on_reregister_and_fences_old_incarnation(server: EmbeddedRedis, prefix: str) -> None:
    reg = WorkerRegistry(server.url, prefix=prefix, ttl_s=5.0)
    first = reg.register("d0", "decode")
    second = reg.register("d0", "decode")
    assert second > first
    assert [w.epoch for w in reg.live_workers()] == [second]
    assert not reg.heartbeat("d0", first) and reg.heartbeat("d0", second)
    assert not reg.deregister("d0", first)  # the old incarnation cannot remove the new one
    lost: list[bool] = []
    beat = Heartbeat(WorkerRegistry(server.url, prefix=prefix, ttl_s=0.3), "d0", first, lambda: lost.append(True))
    beat.start()
    assert wait_for(beat.lost.is_set, timeout_s=3.0) and lost == [True]
    beat.stop()
    assert reg.deregister("d0", second) and reg.live_workers() == []
    assert reg.register("d0", "decode") > second  # epochs survive deregistration


def test_epochs_keep_growing_after_redis_loses_its_data(server: EmbeddedRedis, prefix: str) -> None:
    reg = WorkerRegistry(server.url, prefix=prefix, ttl_s=5.0)
    before = [reg.register("d0", "decode") for _ in range(3)]
    client = redis.Redis.from_url(server.url)
    client.delete(*client.keys(f"{prefix}:*"))  # as a Redis without persistence comes back: empty
    after = reg.register("d0", "decode")
    assert before == sorted(set(before)) and after > before[-1]
    assert after * 8 + 7 < 2**53  # a block entry stays exact as a Lua number
    assert [w.epoch for w in reg.live_workers()] == [after] and reg.heartbeat("d0", after)


def test_live_workers_filters_by_role(server: EmbeddedRedis, prefix: str) -> None:
    reg = WorkerRegistry(server.url, prefix=prefix)
    for wid, role in [("p1", "prefill"), ("d1", "decode"), ("p0", "prefill")]:
        reg.register(wid, role)
    assert [w.worker_id for w in reg.live_workers("prefill")] == ["p0", "p1"]
    assert [w.worker_id for w in reg.live_workers("decode")] == ["d1"]
    assert len(reg.live_workers()) == 3
    assert WorkerRegistry(server.url, prefix=prefix + "-other").live_workers() == []


def test_the_embedded_server_has_a_random_password_by_default() -> None:
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.password and b.password and a.password != b.password and len(a.password) >= 24
        assert a.password not in a.shown_url and "***" in a.shown_url
        with pytest.raises(redis.AuthenticationError):  # a stranger on this machine, without it
            redis.Redis(host="127.0.0.1", port=a.port).ping()
        assert redis.Redis.from_url(a.url).ping()
    with EmbeddedRedis(password="") as open_:  # the explicit opt-out
        assert redis.Redis(host="127.0.0.1", port=open_.port).ping()


def test_password_is_required_and_checked() -> None:
    with EmbeddedRedis(password="s3cret pw") as srv:
        assert srv.url == f"redis://:s3cret%20pw@127.0.0.1:{srv.port}/0"
        bare = f"redis://127.0.0.1:{srv.port}/0"
        with pytest.raises(RegistryError, match="requires a password") as no_pw:
            WorkerRegistry(bare)
        with pytest.raises(RegistryError, match="refused the password") as wrong:
            WorkerRegistry(f"redis://:wrong-pw@127.0.0.1:{srv.port}/0")
        assert "wrong-pw" not in str(wrong.value) and "***" in str(wrong.value)
        assert "s3cret" not in str(no_pw.value)
        reg = WorkerRegistry(srv.url, prefix="auth")
        reg.register("w", "prefill")
        assert [w.worker_id for w in reg.live_workers()] == ["w"]


def test_unreachable_redis_is_a_clear_error() -> None:
    srv = EmbeddedRedis().start()
    url = srv.url
    srv.stop()  # a port nothing listens on any more
    with pytest.raises(RegistryError, match="cannot reach Redis at redis://\\*\\*\\*@127.0.0.1"):
        WorkerRegistry(url)
