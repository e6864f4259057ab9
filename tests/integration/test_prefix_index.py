"""The Redis prefix index and the workers' publisher, against a real redis-server."""
from __future__ import annotations

import random
import uuid
from collections.abc import Iterator

import pytest
import redis
from support import wait_for

from cluster.redis_server import EmbeddedRedis
from engine.block_hash import chain_hashes
from engine.cache_events import TIERS, CacheEvent
from router.config import IndexConfig
from router.index.keys import TIER_BITS
from router.index.publisher import IndexPublisher
from router.index.query import PrefixHit, PrefixIndex
from router.index.registry import RegistryError, connect

pytestmark = pytest.mark.timeout(120)
MODEL = "tiny"


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture
def cfg() -> IndexConfig:
    return IndexConfig(key_prefix=f"t{uuid.uuid4().hex[:8]}", lease_ttl_s=10.0, publish_interval_s=0.02)


class Events:
    """A stand-in for the engine's event log: what the publisher takes next."""

    def __init__(self) -> None:
        self.pending: list[CacheEvent] = []

    def take(self) -> list[CacheEvent]:
        out, self.pending = self.pending, []
        return out


def publisher(url: str, cfg: IndexConfig, worker_id: str, role: str = "prefill") -> tuple[IndexPublisher, Events]:
    events = Events()
    return IndexPublisher(cfg, url, worker_id, role, MODEL, events.take), events


def reference_hit(held: dict[bytes, int], hashes: list[bytes]) -> PrefixHit:
    n = dev = host = disk = 0
    for h in hashes:
        mask = held.get(h, 0)
        if not mask:
            break
        n += 1
        dev, host, disk = dev + (mask & 1 > 0), host + (mask & 3 == 2), disk + (mask == 4)
    return PrefixHit(n, dev, host, disk)




@pytest.mark.parametrize("seed", [0, 1, 2])
def test_index_matches_reference_under_random_events(server: EmbeddedRedis, cfg: IndexConfig, seed: int) -> None:
    rng = random.Random(seed)
    # A forest of chains sharing prefixes, like conversations sharing a system prompt.
    trunk = [rng.randrange(4096) for _ in range(4 * 6)]
    chains = [chain_hashes(trunk[: 4 * rng.randrange(0, 7)] + [rng.randrange(4096) for _ in range(4 * 8)], 4, MODEL)
              for _ in range(6)]
    blocks = sorted({h for c in chains for h in c})
    pubs = {w: publisher(server.url, cfg, w) for w in ("w0", "w1", "w2")}
    held: dict[str, dict[bytes, int]] = {w: {} for w in pubs}
    index = PrefixIndex(connect(server.url), cfg.key_prefix, MODEL)
    try:
        for p, _ in pubs.values():
            p.step()
        for _round in range(25):
            for _ in range(rng.randrange(1, 40)):
                w, tier = rng.choice(sorted(pubs)), rng.choice(TIERS)
                kind = rng.choice(["stored", "stored", "removed"])
                hashes = tuple(rng.sample(blocks, rng.randrange(1, 6)))
                pubs[w][1].pending.append(CacheEvent(kind, tier, hashes))
                for h in hashes:
                    mask = held[w].get(h, 0)
                    held[w][h] = mask | TIER_BITS[tier] if kind == "stored" else mask & ~TIER_BITS[tier]
            for p, _ in pubs.values():
                p.step()
            live = index.live_epochs()
            assert sorted(live) == sorted(pubs)
            for chain in chains:
                query = chain[: rng.randrange(1, len(chain) + 1)]
                assert index.query(query, live) == {w: reference_hit(held[w], query) for w in pubs}
    finally:
        for p, _ in pubs.values():
            p.stop()


def test_new_epoch_and_expired_lease_drop_entries(server: EmbeddedRedis, cfg: IndexConfig) -> None:
    cfg = cfg.model_copy(update={"lease_ttl_s": 0.6})
    hashes = chain_hashes(list(range(40)), 4, MODEL)
    index = PrefixIndex(connect(server.url), cfg.key_prefix, MODEL)
    a, a_events = publisher(server.url, cfg, "a")
    b, b_events = publisher(server.url, cfg, "b")
    a_events.pending.append(CacheEvent("stored", "device", tuple(hashes)))
    b_events.pending.append(CacheEvent("stored", "host", tuple(hashes[:3])))
    a.start(), b.start()
    try:
        assert wait_for(lambda: index.query(hashes, index.live_epochs())["b"] == PrefixHit(3, 0, 3, 0))
        assert index.query(hashes, index.live_epochs())["a"] == PrefixHit(10, 10, 0, 0)
        old = index.live_epochs()
        # `a` restarts: a new registration (epoch) whose cache is empty. Its old entries stop counting.
        a.stop()
        a2, _ = publisher(server.url, cfg, "a")
        a2.start()
        try:
            live = index.live_epochs()
            assert live["a"] > old["a"]
            assert index.query(hashes, live)["a"] == PrefixHit()
        finally:
            a2.stop()
        # `b` stops heartbeating without ending its lease (a crash): it expires and leaves the answers.
        b._stop.set()
        b._thread.join()
        assert "b" in index.live_epochs()
        assert wait_for(lambda: "b" not in index.live_epochs(), timeout_s=5)
        assert "b" not in index.query(hashes, index.live_epochs())
    finally:
        a.stop()
        b._stop.set()


def test_resync_flag_and_redis_restart_republish(cfg: IndexConfig) -> None:
    hashes = chain_hashes(list(range(64)), 4, MODEL)
    srv = EmbeddedRedis().start()
    port = srv.port
    pub, events = publisher(srv.url, cfg, "p0")
    events.pending.append(CacheEvent("stored", "device", tuple(hashes)))
    pub.start()
    index = PrefixIndex(connect(srv.url), cfg.key_prefix, MODEL)
    try:
        assert wait_for(lambda: index.query(hashes, index.live_epochs()).get("p0") == PrefixHit(16, 16, 0, 0))
        # Someone deletes entries behind the worker's back, then asks for a resync: they come back.
        index.redis.delete(index.keys.block(hashes[0]))
        assert index.query(hashes, index.live_epochs())["p0"] == PrefixHit()
        resyncs = pub.resyncs
        index.request_resync("p0")
        assert wait_for(lambda: index.query(hashes, index.live_epochs())["p0"].blocks == 16)
        assert pub.resyncs == resyncs + 1

        epoch = index.live_epochs()["p0"]
        srv.stop()  # Redis dies and comes back empty on the same port
        assert wait_for(lambda: not pub.connected)
        events.pending.append(CacheEvent("removed", "device", tuple(hashes[8:])))  # the cache moves on meanwhile
        srv = EmbeddedRedis(port=port, password=srv.password).start()  # the same URL as before
        assert wait_for(lambda: pub.connected)
        assert wait_for(lambda: "p0" in index.live_epochs())  # registered again (epochs restart with Redis)
        assert pub.epoch == index.live_epochs()["p0"] and epoch >= 1
        assert wait_for(lambda: index.query(hashes, index.live_epochs())["p0"] == PrefixHit(8, 8, 0, 0))
    finally:
        pub.stop()
        srv.stop()


def test_acl_user_limited_to_the_prefix(server: EmbeddedRedis, cfg: IndexConfig) -> None:
    admin = redis.Redis.from_url(server.url)
    user = f"u{uuid.uuid4().hex[:6]}"
    admin.execute_command("ACL", "SETUSER", user, "on", ">s3cret", f"~{cfg.key_prefix}:*", "+@all", "-@dangerous")
    admin.set("outside", 1)
    url = f"redis://{user}:s3cret@127.0.0.1:{server.port}/0"
    hashes = chain_hashes(list(range(20)), 4, MODEL)
    pub, events = publisher(url, cfg, "acl-w")
    events.pending.append(CacheEvent("stored", "disk", tuple(hashes)))
    pub.start()
    try:
        index = PrefixIndex(connect(url), cfg.key_prefix, MODEL)
        assert wait_for(lambda: index.query(hashes, index.live_epochs()).get("acl-w") == PrefixHit(5, 0, 0, 5))
        with pytest.raises(redis.exceptions.NoPermissionError):
            index.redis.get("outside")  # the user really is confined to the prefix
    finally:
        pub.stop()
    with pytest.raises(RegistryError, match="refused the password"):
        publisher(f"redis://{user}:wrong@127.0.0.1:{server.port}/0", cfg, "acl-w")


def test_salted_chains_never_meet_in_the_index(server: EmbeddedRedis, cfg: IndexConfig) -> None:
    from engine.block_hash import salted_root

    tokens = list(range(32))
    acme = chain_hashes(tokens, 4, MODEL, parent=salted_root("acme"))
    pub, events = publisher(server.url, cfg, "s0")
    events.pending.append(CacheEvent("stored", "device", tuple(acme)))
    pub.start()
    try:
        index = PrefixIndex(connect(server.url), cfg.key_prefix, MODEL)
        assert wait_for(lambda: index.query(acme, index.live_epochs()).get("s0") == PrefixHit(8, 8, 0, 0))
        for other in (chain_hashes(tokens, 4, MODEL), chain_hashes(tokens, 4, MODEL, parent=salted_root("globex")),
                      chain_hashes(tokens, 4, "tiny-moe", parent=salted_root("acme"))):
            assert index.query(other, index.live_epochs())["s0"] == PrefixHit()
    finally:
        pub.stop()


def test_a_worker_started_while_redis_is_down_registers_when_it_returns(cfg: IndexConfig) -> None:
    first = EmbeddedRedis().start()
    first.stop()  # a port that is free now
    srv = EmbeddedRedis(port=first.port)  # not started yet
    pub, events = publisher(srv.url, cfg, "late")  # no error: the worker serves on without the index
    events.pending.append(CacheEvent("stored", "device", tuple(chain_hashes(list(range(8)), 4, MODEL))))
    pub.start()
    try:
        assert not pub.connected and pub.epoch is None
        srv.start()
        index = PrefixIndex(connect(srv.url), cfg.key_prefix, MODEL)
        assert wait_for(lambda: index.query(chain_hashes(list(range(8)), 4, MODEL),
                                              index.live_epochs()).get("late") == PrefixHit(2, 2, 0, 0))
        assert pub.connected
    finally:
        pub.stop()
        srv.stop()


@pytest.mark.usefixtures("torch_single_thread")
def test_a_plain_prefill_worker_publishes_its_engine_cache_and_ends_its_lease(server: EmbeddedRedis,
                                                                              cfg: IndexConfig) -> None:
    from functools import partial

    from engine import CacheConfig, EngineConfig, SamplingParams
    from engine.messages import GenerateRequest
    from kv_transfer import TransferConfig
    from prefill_worker import PrefillWorker
    from router.config import IndexLink
    from router.index.publisher import worker_publisher

    cache = CacheConfig(num_blocks=64, record_events=True)  # as cluster.config.worker_config sets it
    worker = PrefillWorker("pw", EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=cache),
                           TransferConfig(backend="gloo"),
                           partial(worker_publisher, IndexLink(redis_url=server.url, index=cfg)))
    model = worker.engine.model_id  # "tiny@<checkpoint fingerprint>": what the worker hashes with
    index = PrefixIndex(connect(server.url), cfg.key_prefix, model)
    prompt = list(range(3, 3 + 70))  # 4 full blocks of 16
    try:
        assert list(index.live_epochs()) == ["pw"]
        done = worker.prefill(GenerateRequest("r", prompt, SamplingParams(max_tokens=2))).result(timeout=60)
        assert done.usage.prompt_tokens == 70
        hashes = chain_hashes(prompt, 16, model)
        assert wait_for(lambda: index.query(hashes, index.live_epochs())["pw"] == PrefixHit(4, 4, 0, 0))
        assert worker.health().index["blocks"] == 4
    finally:
        worker.close()
    assert "pw" not in index.live_epochs()  # a graceful stop ends the lease at once


@pytest.fixture
def tls_redis(tmp_path):
    """A real redis-server speaking TLS only, with a self-signed certificate for 127.0.0.1."""
    import shutil
    import socket
    import subprocess

    from cluster.redis_server import find_redis_server

    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make the test certificate"
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([find_redis_server(), "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                             "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        assert wait_for(lambda: _answers(url)), "the TLS redis-server did not come up"
        yield url, port
    finally:
        proc.terminate()
        proc.wait(10)


def _answers(url: str) -> bool:
    try:
        return redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
    except redis.RedisError:
        return False


def test_the_index_works_over_tls(tls_redis, cfg: IndexConfig) -> None:
    url, port = tls_redis
    hashes = chain_hashes(list(range(12)), 4, MODEL)
    pub, events = publisher(url, cfg, "tls-w")
    events.pending.append(CacheEvent("stored", "host", tuple(hashes)))
    pub.start()
    try:
        index = PrefixIndex(connect(url), cfg.key_prefix, MODEL)
        assert index.redis.connection_pool.connection_class is redis.connection.SSLConnection
        assert wait_for(lambda: index.query(hashes, index.live_epochs()).get("tls-w") == PrefixHit(3, 0, 3, 0))
    finally:
        pub.stop()
    with pytest.raises(RegistryError, match="cannot reach Redis"):  # plain text to a TLS port: refused, said so
        connect(f"redis://127.0.0.1:{port}/0", socket_timeout=1.0)
