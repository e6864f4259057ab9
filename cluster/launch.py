"""Start or join Ray and place the router, prefill and decode actors (no front door here).

The composition root of a cluster: each worker gets its engine config from
cluster.config.worker_config, and, when the cluster has a prefix index, its cache-event
publisher (router.index.publisher) handed in as a factory, so no worker imports the router."""
from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from functools import partial

import psutil
import ray
from ray.exceptions import ActorAlreadyExistsError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cluster.config import ClusterConfig, cpu_budget, worker_config
from decode_worker.actor import DecodeActor
from decode_worker.group import Group, start_group, stop_group
from engine import Role
from kv_transfer.config import NODE_HOST, TransferConfig
from prefill_worker.actor import PrefillActor
from router.actor import RouterActor
from router.config import IndexLink
from router.index.publisher import publishes_events, worker_publisher

log = logging.getLogger(__name__)
NAMESPACE = "brigade"
OBJECT_STORE_BYTES = 256 << 20  # KV moves over torch.distributed, not the object store
START_TIMEOUT_S = 600.0  # a worker's start: loading weights, a placement group, pairing with its peers
SHUTDOWN_NAMES_S = 10.0  # Cluster.shutdown waits this long at most for Ray to free its workers' names


class WorkerNameTaken(RuntimeError):
    """Another Brigade cluster in this Ray already runs a worker of that id (actor names are Ray-wide)."""


def start_ray(cfg: ClusterConfig, attempts: int = 2) -> None:
    """Ray for this process: attached to cfg.ray_address, else a new local node, started up to
    `attempts` times (a loaded machine's bootstrap now and then misses Ray's own wait)."""
    if ray.is_initialized():
        return
    env = {"RAY_USAGE_STATS_ENABLED": "0"}
    if cfg.ray_address:
        # The driver attaches to the Ray node at its own --host (one of several nodes on a
        # machine, or the pod's); Ray maps 127.0.0.1 and names to this machine's node itself.
        ray.init(address=cfg.ray_address, namespace=NAMESPACE, runtime_env={"env_vars": env},
                 _node_ip_address=host_ip(cfg.host))
        return
    if is_loopback(cfg.host):
        _keep_ray_on_loopback()
    # Local: Ray's CPU counts are bookkeeping only; each worker sets its own torch threads.
    # Twice the budget leaves room for workers added after start. address "local": a new Ray,
    # never one that RAY_ADDRESS or an earlier `ray start` on this machine left behind.
    options = dict(address="local", num_cpus=int(2 * max(cpu_budget(cfg), 1)), include_dashboard=False,
                   namespace=NAMESPACE,
                   object_store_memory=OBJECT_STORE_BYTES, _node_ip_address=cfg.host,
                   resources=local_resources(cfg) or None, runtime_env={"env_vars": env})
    for attempt in range(1, attempts + 1):
        ours = {p.pid for p in psutil.Process().children(recursive=True)}  # redis-server, if embedded
        try:
            ray.init(**options)
            return
        except Exception as exc:  # noqa: BLE001 - Ray raises plain Exception for a node that timed out
            if attempt == attempts:
                raise
            # On a loaded machine Ray's own bootstrap now and then misses a fixed 30 s wait (the
            # GCS writes no port file, or the raylet registers late): stop what it started, once more.
            print(f"Ray did not start ({str(exc).splitlines()[0][:200]}); stopping what it started and "
                  "trying once more", file=sys.stderr, flush=True)
            _stop_new_processes(ours)


def _stop_new_processes(before: set[int], grace_s: float = 5.0) -> None:
    """ray.shutdown(), then stop every process under this one that was not there `before`
    (a half-started Ray's daemons and agents)."""
    with contextlib.suppress(Exception):
        ray.shutdown()
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for p in new:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(new, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def local_resources(cfg: ClusterConfig) -> dict[str, float]:
    """The `placement` resources a local Ray provides itself (on a cluster its nodes do), twice
    what the workers take, as with CPUs, so a config written for KubeRay also runs locally."""
    out: dict[str, float] = {}
    roles = [("prefill", cfg.num_prefill), ("mixed" if cfg.mode == "colocated" else "decode", cfg.decode)]
    for role, workers in roles:
        for name, per_rank in cfg.placement.resources(role).items():
            out[name] = out.get(name, 0.0) + 2 * workers * cfg.parallel.ranks(role) * per_rank
    return out


def host_ip(host: str) -> str | None:
    """`host` if it is an IP address literal, else None (Ray then finds this machine's node)."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return None


def on_this_node() -> NodeAffinitySchedulingStrategy:
    """Pinned to the driver's own Ray node: the router lives and dies with its front, never on a
    worker node whose loss would take every request with it."""
    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _keep_ray_on_loopback() -> None:
    """Make a local Ray bind loopback only.

    Ray (2.60) turns a loopback `_node_ip_address` into the machine's routable address unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, and with a routable node address its GCS, raylet and
    worker gRPC servers listen on every interface (`::`). With the node address 127.0.0.1 every
    daemon and worker listens on 127.0.0.1 only (tests/integration/test_serve.py checks it). The variable is
    read at `import ray` (hence the constant too) and inherited by the daemons Ray spawns.
    """
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False


def wants_gpu(cfg: ClusterConfig) -> bool:
    if cfg.engine.device != "auto":
        return cfg.engine.device.startswith("cuda")
    return ray.cluster_resources().get("GPU", 0) > 0


@dataclass
class Placement:
    options: dict  # Ray actor options
    num_threads: int | None  # torch threads in the worker (None on GPU)


def placements(cfg: ClusterConfig, num_workers: int) -> Placement:
    """One worker's share: a GPU each on GPU machines, else an equal share of the cores."""
    if wants_gpu(cfg):
        gpus = ray.cluster_resources().get("GPU", 0)
        if num_workers > gpus:
            raise ValueError(f"{num_workers} workers need {num_workers} GPUs; the Ray cluster has {gpus:g}")
        return Placement({"num_gpus": 1}, None)
    share = cpu_budget(cfg) / num_workers
    return Placement({"num_cpus": share}, max(1, int(share)))


@dataclass
class Cluster:
    cfg: ClusterConfig
    router: object
    index: IndexLink | None = None  # the prefix index and leases in Redis; None: routing by load only
    workers: dict[str, object] = field(default_factory=dict)  # worker id -> actor handle
    roles: dict[str, str] = field(default_factory=dict)  # worker id -> "prefill" | "decode" | "mixed"
    groups: dict[str, Group] = field(default_factory=dict)  # worker id -> its ranks, for TP/EP workers
    retired: list[str] = field(default_factory=list)  # replaced workers' ids, never reused
    transfer: TransferConfig | None = None  # cfg.transfer with this cluster's KV join secret

    def __post_init__(self) -> None:
        self.transfer = (self.transfer or self.cfg.transfer).with_secret()  # one secret for every worker

    def add_worker(self, role: str) -> str:
        """Start one more worker and hand it to the router (which pairs it with its peers)."""
        cfg = self.cfg
        place = placements(cfg, max(1, cfg.num_ranks))
        worker_id = f"{role}-{sum(w.startswith(role + '-') for w in [*self.workers, *self.retired])}"
        publishes = self.index is not None and publishes_events(role)
        engine_cfg = worker_config(cfg, Role(role), worker_id, place.num_threads, publishes)
        publisher = partial(worker_publisher, self.index) if self.index is not None else None

        def start(engine_cfg, options: dict):
            actor = PrefillActor if role == "prefill" else DecodeActor
            opts = {**options, "name": worker_id, "max_concurrency": 1000}
            try:
                return actor.options(**opts).remote(worker_id, engine_cfg, self.transfer, publisher)
            except ActorAlreadyExistsError:
                raise WorkerNameTaken(
                    f"a worker named {worker_id!r} already runs in this Ray cluster (namespace {NAMESPACE!r}): "
                    "another Brigade cluster shares it. Stop that one first, or serve this one from another "
                    "Ray cluster (--ray-address)") from None

        tp, ep = cfg.parallel.sizes(role)
        custom = cfg.placement.resources(role)  # e.g. only the pods of a KubeRay worker group have them
        handle = group = None
        try:
            if max(tp, ep) > 1:
                bundle = {"GPU": 1} if "num_gpus" in place.options else {"CPU": place.options["num_cpus"]}
                # The group's rendezvous is on its own node when transfer.host is "node" (pods), else on --host.
                rendezvous = NODE_HOST if cfg.transfer.host == NODE_HOST else cfg.host
                group = start_group(worker_id, start, engine_cfg, tp, ep, {**bundle, **custom}, rendezvous,
                                    cfg.parallel.timeout_s, receive_kv=self.transfer if role == "decode" else None)
                handle = group.leader
            else:
                handle = start(engine_cfg, {**place.options, "resources": custom} if custom else place.options)
            # Bounded: an actor left pending (no free GPU or placement resource) must not hang its caller.
            ray.get(handle.health.remote(), timeout=START_TIMEOUT_S)  # surfaces a failed start (bad model path...)
            ray.get(self.router.add_worker.remote(role, worker_id, handle), timeout=START_TIMEOUT_S)
        except BaseException:
            # Nothing half-started stays behind, and its name is never reused.
            self.retired.append(worker_id)
            ray.get(self.router.remove_worker.remote(worker_id))
            if group is not None:
                stop_group(group)
            if handle is not None:
                ray.kill(handle)
            raise
        if group is not None:
            self.groups[worker_id] = group
        self.workers[worker_id] = handle
        self.roles[worker_id] = role
        return worker_id

    def replace_worker(self, worker_id: str) -> str:
        """Tear a worker down (a TP/EP worker: all its ranks and its placement group, as a unit)
        and start a fresh one of the same role under a new id; returns that id. The router
        forgets the old one first, so nothing is routed or paired to it meanwhile."""
        role = self.roles.pop(worker_id)
        ray.get(self.router.remove_worker.remote(worker_id))
        handle = self.workers.pop(worker_id)
        self.retired.append(worker_id)
        ray.kill(handle)
        group = self.groups.pop(worker_id, None)
        if group is not None:
            stop_group(group)
        return self.add_worker(role)  # if this fails, the supervisor starts one later (Supervisor.owed)

    def stats(self) -> dict:
        return ray.get(self.router.stats.remote())

    def shutdown(self) -> None:
        for handle in self.workers.values():
            try:
                ray.get(handle.shutdown.remote(), timeout=10)
            except Exception as exc:  # already dead: nothing to drain
                log.warning("worker shutdown: %s", exc)
            ray.kill(handle)
        for group in self.groups.values():
            stop_group(group)
        ray.kill(self.router)
        # ray.kill returns before Ray frees the actors' names: wait, so a cluster started next in
        # this Ray (a restarted owner) can take the same worker ids.
        names, deadline = set(self.workers), time.monotonic() + SHUTDOWN_NAMES_S
        with contextlib.suppress(Exception):  # Ray itself going down: nothing left to free
            while names & set(ray.util.list_named_actors()) and time.monotonic() < deadline:
                time.sleep(0.05)
        self.workers.clear()
        self.groups.clear()


def launch(cfg: ClusterConfig, redis_url: str | None = None) -> Cluster:
    """The router and the workers; with `redis_url` (default: cfg.redis_url) each worker keeps
    its own lease and publishes its cache events there, and the router routes by the index."""
    start_ray(cfg)
    url = redis_url or cfg.redis_url
    index = IndexLink(redis_url=url, index=cfg.index) if url else None
    router = RouterActor.options(num_cpus=0, max_concurrency=10_000, scheduling_strategy=on_this_node()).remote(
        cfg.router, cfg.mode == "colocated", index)
    cluster = Cluster(cfg, router, index=index)
    roles = ["prefill"] * cfg.num_prefill + (["mixed"] if cfg.mode == "colocated" else ["decode"]) * cfg.decode
    try:
        for role in roles:
            cluster.add_worker(role)
    except BaseException:  # a half-started cluster leaves nothing running behind: its router, its workers
        cluster.shutdown()
        raise
    log.info("cluster up: %s (pid %d)", sorted(cluster.workers), os.getpid())
    return cluster
