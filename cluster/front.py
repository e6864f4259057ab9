"""An extra front (`brigade serve --front-only`, config `role: front`): its own router (and, in
serve, its own doors) over workers another `brigade serve` (the owner) started on the same Ray
cluster. It starts, supervises and pairs nothing; it comes and goes without the workers noticing.

Membership comes from Ray itself, not from Redis: the owner names every worker's actor by its
worker id (prefill-N, decode-N, mixed-N) in the cluster's namespace, and a name lives exactly as
long as its actor. Every `interval_s` the front lists those names, hands new workers to its
router and takes away the ones that are gone (the owner replaced them, or their node died). The
router checks their health and takes their pairs from their health reports (router/pool.py,
owns_pairs=False). Redis holds only hints, so a front starts and serves by load while Redis is
down, and its router picks the shared prefix index up when Redis answers (router/index/view.py).
"""
from __future__ import annotations

import logging
import re
import threading
import time

import ray

from cluster.config import ClusterConfig
from cluster.launch import on_this_node, start_ray
from router.actor import RouterActor
from router.config import IndexLink

log = logging.getLogger(__name__)
WORKER_NAME = re.compile(r"^(prefill|decode|mixed)-\d+$")  # cluster.launch.Cluster.add_worker's ids
CALL_TIMEOUT_S = 30.0  # a router call while a worker it adds is slow to answer its first health check


class Front:
    """The front's router and what it knows of the owner's workers (worker id -> actor handle).
    Offers what serve needs of a cluster: `router`, `stats()`, `shutdown()`."""

    def __init__(self, cfg: ClusterConfig, redis_url: str | None, interval_s: float = 1.0):
        start_ray(cfg)
        index = IndexLink(redis_url=redis_url, index=cfg.index) if redis_url else None
        self.cfg, self.interval_s = cfg, interval_s
        self.router = RouterActor.options(num_cpus=0, max_concurrency=10_000,
                                          scheduling_strategy=on_this_node()).remote(
            cfg.router, cfg.mode == "colocated", index, owns_pairs=False)
        self.workers: dict[str, object] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="front-discovery", daemon=True)

    def start(self, wait_s: float = 120.0) -> Front:
        """Discover the workers now (waiting up to `wait_s` for one of every needed role), then
        keep up with them in the background."""
        roles = {"mixed"} if self.cfg.mode == "colocated" else {"prefill", "decode"}
        if not _wait(lambda: roles <= {w.rsplit("-", 1)[0] for w in self.discover()}, wait_s, self.interval_s):
            raise RuntimeError(f"no {' and '.join(sorted(roles))} workers of the cluster at {self.cfg.ray_address} "
                               f"answered within {wait_s:g} s: is its owner (`brigade serve` without "
                               "--front-only) running, with the same --mode?")
        self._thread.start()
        return self

    def discover(self) -> list[str]:
        """One round: add the workers that appeared, remove the ones gone; the ids the router has."""
        names = {n for n in ray.util.list_named_actors() if WORKER_NAME.match(n)}
        for worker_id in sorted(set(self.workers) - names):
            ray.get(self.router.remove_worker.remote(worker_id), timeout=CALL_TIMEOUT_S)
            self.workers.pop(worker_id)
            log.warning("front: worker %s left the cluster", worker_id)
        for worker_id in sorted(names - set(self.workers)):
            try:
                handle = ray.get_actor(worker_id)
                ray.get(self.router.add_worker.remote(worker_id.rsplit("-", 1)[0], worker_id, handle),
                        timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # still starting, or gone again: the next round tries again
                log.info("front: worker %s not added yet: %r", worker_id, exc)
                continue
            self.workers[worker_id] = handle
            log.warning("front: routing to worker %s", worker_id)
        return sorted(self.workers)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.discover()
            except Exception as exc:  # a slow GCS or router: next round
                log.error("front: discovery round failed: %r", exc)

    def stats(self) -> dict:
        return ray.get(self.router.stats.remote(), timeout=CALL_TIMEOUT_S)

    def shutdown(self) -> None:
        """Stop discovering and end this front's router; the workers are the owner's and stay."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(CALL_TIMEOUT_S)
        ray.kill(self.router)


def _wait(predicate, timeout_s: float, interval_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if predicate():
                return True
        except Exception as exc:  # noqa: BLE001 - the GCS or router was slow: keep trying until the deadline
            log.info("front: waiting for workers: %r", exc)
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
