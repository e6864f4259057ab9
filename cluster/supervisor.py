"""Keeps the cluster whole: a worker the router has judged unhealthy for `grace_s` is torn
down (a TP/EP worker with all its ranks and its placement group, as a unit) and a fresh
worker of the same role takes its place under a new id, paired with its peers like any new
worker. Until then the router sends it nothing, so a partial group never gets traffic.

The grace period keeps a brief stall (a long step, a slow health answer) from costing the
requests in flight; a dead actor or a group that lost a rank stays unhealthy and is replaced.
"""
from __future__ import annotations

import logging
import threading
import time

import ray

from cluster.config import SupervisorConfig

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, cluster, cfg: SupervisorConfig):
        self.cluster, self.cfg = cluster, cfg
        self.replaced: list[tuple[str, str]] = []  # (old id, new id), oldest first
        self.owed: list[str] = []  # roles of workers torn down whose replacement failed to start: retried
        self._down_since: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.cfg.status_timeout_s)  # a start in progress is bounded by its own timeout

    def check_once(self, now: float | None = None) -> list[tuple[str, str]]:
        """Replace every worker unhealthy for at least grace_s; returns (old id, new id) pairs."""
        now = time.monotonic() if now is None else now
        for role in list(self.owed):
            new_id = self.cluster.add_worker(role)  # raises again if it still cannot start: next round
            self.owed.remove(role)
            log.warning("started %s in place of a worker whose replacement had failed", new_id)
        status = ray.get(self.cluster.router.status.remote(), timeout=self.cfg.status_timeout_s)
        done = []
        for worker_id, w in status["workers"].items():
            if worker_id not in self.cluster.workers or w["healthy"]:
                self._down_since.pop(worker_id, None)
                continue
            if now - self._down_since.setdefault(worker_id, now) < self.cfg.grace_s:
                continue
            log.warning("worker %s unhealthy for %.0f s: replacing it", worker_id, now - self._down_since[worker_id])
            self._down_since.pop(worker_id, None)
            try:
                new_id = self.cluster.replace_worker(worker_id)
            except Exception:
                if worker_id not in self.cluster.workers:  # torn down, its successor failed: owed
                    self.owed.append(worker_id.rsplit("-", 1)[0])
                raise
            self.replaced.append((worker_id, new_id))
            done.append((worker_id, new_id))
            log.warning("worker %s replaced by %s", worker_id, new_id)
        return done

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.interval_s):
            try:
                self.check_once()
            except Exception as exc:  # a failed start or a slow router: try again next round
                log.error("supervisor: %r", exc)
