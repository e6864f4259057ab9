"""Brigade on a real multi-node Ray cluster (benchmarks/harness/ray_nodes.py): a head at 127.0.19.1 and two
worker nodes, 127.0.19.2 with the `prefill` resource and 127.0.19.3 with `decode`, each its own
raylet and object store, Ray token auth on. `brigade serve --ray-address` joins it as a real
deployment does (the owner front: it starts the workers), with a shared redis-server.

Checked: each node is its own Ray node; prefill workers land on the prefill node and the decode
worker (a TP=2 group, both ranks) on the decode node by the `placement` resources; each worker's
KV transfer address is its own node's, the KV pair runs between the two nodes' addresses, and
nothing Brigade opens listens on a wildcard; greedy tokens equal one engine's.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from serve_process import Served, brigade_serve

from benchmarks.harness.ray_nodes import HEAD_IP, RayNodes
from router.index.view import IndexView

pytestmark = pytest.mark.extended  # multi-node Ray: `make test-extended`, not `make test`

PREFILL_IP, DECODE_IP = "127.0.19.2", "127.0.19.3"
PREFILL_WORKERS = ("prefill-0", "prefill-1")  # the owner's --prefill 2, by their Ray actor names
PLACEMENT = {"placement": {"prefill": {"prefill": 1}, "decode": {"decode": 1}}, "transfer": {"host": "node"}}
PROMPT = [5, 17, 42, 99, 7, 3, 250, 1000, 64, 12, 8, 400, 33, 21, 77, 90, 1, 2, 3, 4]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayNodes]:
    cluster = RayNodes(tmp_path_factory.mktemp("ray-nodes"))
    with cluster.client():  # this process's Ray client (ray.init below) uses the token too
        try:
            cluster.start_head()  # no CPUs: no worker is placed on the head, only the fronts' routers
            cluster.add(PREFILL_IP, {"prefill": 2})
            cluster.add(DECODE_IP, {"decode": 2})
            yield cluster
        finally:
            import ray

            ray.shutdown()
            cluster.stop()


@pytest.fixture(scope="module")
def shared_redis(redis_server) -> str:
    """One redis-server the fronts share (its URL carries the password)."""
    return redis_server.url


@pytest.fixture(scope="module")
def owner(nodes: RayNodes, shared_redis: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The owner front on the head node: joins the cluster, starts the workers, serves."""
    tmp = tmp_path_factory.mktemp("owner")
    config = tmp / "cluster.yaml"
    config.write_text(json.dumps(PLACEMENT))
    flags = ["--ray-address", nodes.address, "--host", HEAD_IP, "--http-port", "0", "--grpc-port", "0",
             "--config", str(config), "--redis-url", shared_redis, "--num-blocks", "128", "--num-cpus", "2",
             "--prefill", "2", "--decode", "1", "--decode-tp", "2"]
    with brigade_serve(flags, tmp / "serve.log", timeout_s=600, env=nodes.env) as served:
        yield served


@pytest.fixture(scope="module")
def driver(nodes: RayNodes, owner: Served):
    """This test process as a Ray driver on the head node (to look at the workers' actors)."""
    import ray

    ray.init(address=nodes.address, namespace="brigade", _node_ip_address=HEAD_IP)
    return ray


@pytest.fixture(scope="module")
def reference(torch_single_thread) -> list[int]:
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", cache=CacheConfig(num_blocks=128)))
    return engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].token_ids


def complete(base: str, prompt: list[int], max_tokens: int = 16, timeout_s: float = 120) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def test_each_node_is_its_own_ray_node_with_its_own_address_and_resources(nodes: RayNodes) -> None:
    table = {n["ip"]: n for n in nodes.node_table() if n["alive"]}
    assert set(table) == {HEAD_IP, PREFILL_IP, DECODE_IP}
    assert table[PREFILL_IP]["resources"]["prefill"] == 2 and "decode" not in table[PREFILL_IP]["resources"]
    assert table[DECODE_IP]["resources"]["decode"] == 2 and "prefill" not in table[DECODE_IP]["resources"]
    assert table[HEAD_IP]["resources"].get("CPU", 0) == 0
    for node in nodes.nodes:  # its own raylet (with its own object store) on its own address
        raylets = [p for p in node.processes() if p.name() == "raylet"]
        assert len(raylets) == 1 and f"--node_ip_address={node.ip}" in raylets[0].cmdline()


def test_a_driver_without_the_token_is_refused(nodes: RayNodes) -> None:
    import subprocess
    import sys

    code = f"import ray; ray.init(address={nodes.address!r}, _node_ip_address={HEAD_IP!r})"
    env = {**os.environ, **nodes.env, "RAY_AUTH_TOKEN": "not-the-token-" + "0" * 20}
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode != 0 and ("Authentication" in res.stderr or "Failed to connect" in res.stderr), \
        res.stderr[-2000:]


def test_prefill_and_decode_workers_land_on_their_own_nodes_and_a_tp_group_on_one(nodes: RayNodes, owner: Served,
                                                                                 reference: list[int]) -> None:
    assert nodes.node(PREFILL_IP).actor_titles() == ["PrefillActor", "PrefillActor"]
    assert nodes.node(DECODE_IP).actor_titles() == ["DecodeActor", "RankActor"]  # TP=2: both ranks there
    assert nodes.node(HEAD_IP).actor_titles() == ["RouterActor"]  # pinned to its front's node
    out = complete(owner.http_base, PROMPT)
    assert out["choices"][0]["token_ids"] == reference


def _brigade_sockets(node, kind: str) -> list:
    """(process title, connection) of `kind` on the node's Brigade actors, leaving out Ray's own
    core-worker gRPC server (its port is in the node's worker port range)."""
    lo = int(next(a for a in node.proc.args if a.isdigit() and 19100 <= int(a) < 20000 and
                  node.proc.args[node.proc.args.index(a) - 1] == "--min-worker-port"))
    out = []
    for p in node.processes():
        try:
            title = " ".join(p.cmdline()).split()[0]
            if not title.startswith(("ray::PrefillActor", "ray::DecodeActor", "ray::RankActor")):
                continue
            for c in p.net_connections("inet"):
                if (c.status == psutil.CONN_LISTEN) == (kind == "listen") and not lo <= c.laddr.port < lo + 100:
                    out.append((title, c))
        except psutil.Error:
            continue
    return out


def test_kv_transfer_runs_between_the_nodes_addresses_and_nothing_listens_on_a_wildcard(
        nodes: RayNodes, owner: Served, driver) -> None:
    decode = driver.get_actor("decode-0")
    addresses = driver.get(decode.address.remote(), timeout=60)
    assert [host for host, _ in addresses] == [DECODE_IP, DECODE_IP]  # one per rank, both the decode node's
    listening = _brigade_sockets(nodes.node(PREFILL_IP), "listen") + _brigade_sockets(nodes.node(DECODE_IP), "listen")
    assert listening, "found no listening socket of the workers"
    wild = [(t, c.laddr) for t, c in listening if ipaddress.ip_address(c.laddr.ip).is_unspecified]
    assert not wild, wild
    assert all(c.laddr.ip in (PREFILL_IP, DECODE_IP) for _, c in listening), listening
    # The KV pairs (one per decode rank: gloo sockets and each rank's rendezvous store) connect the
    # two nodes' workers at the addresses they listen on, their own nodes'. (An unbound outgoing
    # socket's source is 127.0.0.1 on one machine: the kernel's choice for a loopback route.)
    at = {side: {(c.laddr.ip, c.laddr.port) for _, c in listening if c.laddr.ip == ip}
          for side, ip in (("prefill", PREFILL_IP), ("decode", DECODE_IP))}
    established = {side: [c for _, c in _brigade_sockets(nodes.node(ip), "connections")
                          if c.status == psutil.CONN_ESTABLISHED and c.raddr]
                   for side, ip in (("prefill", PREFILL_IP), ("decode", DECODE_IP))}
    to_decode = [c for c in established["prefill"] if (c.raddr.ip, c.raddr.port) in at["decode"]]
    to_prefill = [c for c in established["decode"] if (c.raddr.ip, c.raddr.port) in at["prefill"]]
    assert to_decode or to_prefill, established
    assert len({c.raddr.port for c in to_decode + to_prefill}) >= 2  # both ranks are paired


def _cross_node_pairs(nodes: RayNodes) -> list:
    """The established connections between the two nodes' workers, as the decode node's processes
    see them: those to an address a prefill-node worker listens on (gloo pairs), plus those from
    the prefill node to an address a decode-node worker listens on."""
    listening = {ip: {(c.laddr.ip, c.laddr.port) for _, c in _brigade_sockets(nodes.node(ip), "listen")}
                 for ip in (PREFILL_IP, DECODE_IP)}
    conns = lambda ip: [c for _, c in _brigade_sockets(nodes.node(ip), "connections")  # noqa: E731
                        if c.status == psutil.CONN_ESTABLISHED and c.raddr]
    return ([c for c in conns(DECODE_IP) if (c.raddr.ip, c.raddr.port) in listening[PREFILL_IP]]
            + [c for c in conns(PREFILL_IP) if (c.raddr.ip, c.raddr.port) in listening[DECODE_IP]])


def _reset(conn) -> None:
    """Abort one TCP connection of another process as a network fault would (`ss -K`, as
    tests/chaos/test_kv_link_faults.py does: needs CAP_NET_ADMIN; the Makefile installs iproute2)."""
    import subprocess

    (lhost, lport), (rhost, rport) = conn.laddr, conn.raddr
    res = subprocess.run(["ss", "-K", "src", lhost, "sport", "=", f":{lport}", "dst", rhost, "dport", "=", f":{rport}"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, f"ss -K could not reset {conn}: {res.stderr}"


def test_a_lost_kv_link_between_nodes_is_recomputed_around_and_the_pair_rebuilt(nodes: RayNodes, owner: Served,
                                                                              reference: list[int]) -> None:
    import shutil

    from support import wait_for

    assert shutil.which("ss"), "iproute2's ss is needed: `make system-deps` installs it"
    log_before = owner.log.read_text()
    links = _cross_node_pairs(nodes)
    assert links, "found no KV link between the nodes"
    for conn in links:
        _reset(conn)
    assert complete(owner.http_base, PROMPT)["choices"][0]["token_ids"] == reference  # over a dead link
    new_log = lambda: owner.log.read_text()[len(log_before):]  # noqa: E731
    wait_for(lambda: "recomputing on decode-0" in new_log(), 60, "the decode worker's recompute logged", 0.5)
    wait_for(lambda: "rebuilding the pair" in new_log(), 60, "the router rebuilding the pair", 0.5)
    old = {(c.laddr.port, c.raddr.port) for c in links}
    wait_for(lambda: {(c.laddr.port, c.raddr.port) for c in _cross_node_pairs(nodes)} - old, 120,
             "new KV links between the nodes", 1.0)
    # Every answer stays exact; a prefill worker whose reset link had not carried KV yet finds out
    # on its next transfer (recompute, rebuild) the same way. Then transfers run clean again.
    clean = 0
    for _ in range(8):
        recomputes = new_log().count("recomputing on decode-0")
        assert complete(owner.http_base, PROMPT)["choices"][0]["token_ids"] == reference
        time.sleep(2.0)  # a recompute's log line reaches the driver's log
        clean = clean + 1 if new_log().count("recomputing on decode-0") == recomputes else 0
        if clean == 2:
            break
    assert clean == 2, new_log()[-3000:]
    # Those all went to the worker holding PROMPT's prefix. The other prefill worker's links were
    # reset too, and an idle worker finds a dead link only at its next transfer: it must carry KV
    # over a rebuilt pair as well, or the next test's first request there is recomputed and its
    # pair is rebuilt under that test.
    _each_prefill_worker_carries_kv(owner)


def _each_prefill_worker_carries_kv(served: Served, timeout_s: float = 180) -> None:
    """Fresh prompts through `served`'s gRPC door (which names each request's prefill worker and
    whether its decode worker recomputed it) until every prefill worker has sent one's KV: a new
    conversation goes to the worker routed the fewest, so the idle one takes the next."""
    import random

    from brigade_client import Client
    from support import wait_for

    rng, carried, answers = random.Random(23), set(), []

    def one_more() -> bool:
        out = client.generate([rng.randrange(3, 4096) for _ in range(40)], max_tokens=2, temperature=0,
                              ignore_eos=True)
        answers.append((out.prefill_worker, out.timing.recomputed))
        if not out.timing.recomputed:
            carried.add(out.prefill_worker)
        return carried >= set(PREFILL_WORKERS)

    with Client(served.grpc_target, timeout=120) as client:
        wait_for(one_more, timeout_s, lambda: f"KV carried by every prefill worker; (worker, recomputed): {answers}",
                 0.25)


# --- more than one front over the same workers ---------------------------------------------------------

def _front(nodes: RayNodes, shared_redis: str, tmp: Path, host: str, router: dict | None = None):
    """`brigade serve --front-only` on `host`'s Ray node: its own doors and router, no workers."""
    flags = ["--front-only", "--ray-address", nodes.address, "--host", host, "--http-port", "0", "--grpc-port", "0",
             "--redis-url", shared_redis]
    if router:
        (tmp / "front.yaml").write_text(json.dumps({"router": router}))
        flags += ["--config", str(tmp / "front.yaml")]
    return brigade_serve(flags, tmp / "front.log", timeout_s=600, env=nodes.env)


@pytest.fixture(scope="module")
def front_b(nodes: RayNodes, owner: Served, shared_redis: str, tmp_path_factory: pytest.TempPathFactory):
    """A second front on the prefill node's address; one request at a time, none waiting (admission per front)."""
    with _front(nodes, shared_redis, tmp_path_factory.mktemp("front-b"), PREFILL_IP,
                {"max_running": 1, "max_waiting": 0}) as served:
        yield served


def health(base: str) -> dict:
    with urllib.request.urlopen(f"{base}/health", timeout=60) as resp:
        return json.loads(resp.read())


def test_a_second_front_serves_the_same_workers_without_starting_any(nodes: RayNodes, owner: Served, front_b: Served,
                                                                     reference: list[int]) -> None:
    assert front_b.out[-1].rstrip().endswith(f"(front over 3 workers of {nodes.address}, disaggregated)"), front_b.out
    assert nodes.node(PREFILL_IP).actor_titles() == ["PrefillActor", "PrefillActor", "RouterActor"]  # B's router, here
    assert nodes.node(DECODE_IP).actor_titles() == ["DecodeActor", "RankActor"]
    assert health(front_b.http_base)["workers"] == {"prefill": 2, "decode": 1}
    assert complete(front_b.http_base, PROMPT)["choices"][0]["token_ids"] == reference


def test_a_prompt_first_sent_to_one_front_is_a_prefix_hit_through_the_other(owner: Served, front_b: Served, driver,
                                                                             shared_redis: str) -> None:
    """Two prefill workers: only the shared index sends B's repeat to the worker A's request warmed."""
    import random

    from support import wait_for

    rng = random.Random(19)
    prompts = [[rng.randrange(3, 4096) for _ in range(80)] for _ in range(4)]  # 5 blocks each
    for prompt in prompts:
        first = complete(owner.http_base, prompt, max_tokens=2)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # A worker publishes its cache events in batches (every 50 ms), after it answered: the
    # index, not the first answer, says when B can find the prefix.
    with _shared_index(driver, shared_redis) as index:
        published = lambda: [_longest_hit(index, p) for p in prompts]  # noqa: E731
        wait_for(lambda: published() == [4] * 4, 60, lambda: f"every prompt's 4 usable blocks published: {published()}",
                 0.05)
    cached = [complete(front_b.http_base, p, max_tokens=2)["usage"]["prompt_tokens_details"]["cached_tokens"]
              for p in prompts]
    assert cached == [64] * 4, cached  # every full block but the last (the last token is always computed)


@contextlib.contextmanager
def _shared_index(driver, redis_url: str) -> Iterator[IndexView]:
    """The prefix index as a front reads it, bound to the model and block size the workers hash with."""
    from router.config import IndexConfig

    report = driver.get(driver.get_actor(PREFILL_WORKERS[0]).health.remote(), timeout=60)
    view = IndexView(redis_url, IndexConfig(), timeout_s=10.0)
    try:
        view.bind(report.model_id, report.block_size)
        yield view
    finally:
        view.close()


def _longest_hit(view: IndexView, prompt: list[int]) -> int:
    """The most leading blocks of `prompt` (those a request can use) any live worker holds, by the index."""
    hits = view.index.query(view.hashes(prompt, None), view.index.live_epochs())
    return max((hit.blocks for hit in hits.values()), default=0)


def test_admission_is_bounded_per_front(owner: Served, front_b: Served) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def status(base: str) -> int:
        try:
            complete(base, PROMPT, max_tokens=48)
            return 200
        except urllib.error.HTTPError as exc:
            return exc.code

    with ThreadPoolExecutor(6) as pool:
        on_b = [pool.submit(status, front_b.http_base) for _ in range(3)]
        on_a = [pool.submit(status, owner.http_base) for _ in range(3)]
        b, a = sorted(f.result() for f in on_b), [f.result() for f in on_a]
    assert a == [200, 200, 200], a  # the owner's own bounds are its own
    assert b[0] == 200 and 429 in b, b  # one running at B, none waiting: the rest refused at once


def test_killing_one_front_leaves_the_other_serving_with_no_failed_request(
        nodes: RayNodes, owner: Served, front_b: Served, reference: list[int]) -> None:
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    def stream_on_a(_: int) -> list[int]:
        return complete(owner.http_base, PROMPT)["choices"][0]["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(stream_on_a, i) for i in range(4)]
        threading.Event().wait(0.5)
        front_b.proc.send_signal(signal.SIGKILL)  # no drain: as a crashed pod
        front_b.proc.wait(60)
        results = [f.result(timeout=300) for f in running]
    assert results == [reference] * 4
    assert complete(owner.http_base, PROMPT)["choices"][0]["token_ids"] == reference
    assert health(owner.http_base)["workers"] == {"prefill": 2, "decode": 1}


def test_a_front_started_while_redis_is_down_serves_by_load_and_picks_the_index_up_later(
        nodes: RayNodes, owner: Served, redis_server, shared_redis: str, tmp_path_factory: pytest.TempPathFactory,
        reference: list[int]) -> None:
    from support import wait_for

    redis_server.stop()
    try:
        with _front(nodes, shared_redis, tmp_path_factory.mktemp("front-c"), DECODE_IP) as front_c:
            assert health(front_c.http_base)["prefix_index"].startswith("unavailable")
            assert complete(front_c.http_base, PROMPT)["choices"][0]["token_ids"] == reference
            redis_server.restart()
            wait_for(lambda: health(front_c.http_base)["prefix_index"] == "ok", 60, "front C's index back", 1.0)
            assert complete(front_c.http_base, PROMPT)["choices"][0]["token_ids"] == reference
    finally:
        if redis_server.proc is None or redis_server.proc.poll() is not None:
            redis_server.restart()
