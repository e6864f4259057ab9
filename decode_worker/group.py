"""A worker of TP (or EP) size k: k Ray actors placed together, one model split over them.

Rank 0 is the ordinary worker actor (DecodeActor or PrefillActor) whose engine holds a
ParallelModelRunner: it schedules, broadcasts each step's batch to the other ranks as int64
tensors over the group (engine.parallel.runner), samples and streams. Ranks 1..k-1 are
RankActors: they load their shard of the weights and run follow() on a thread until rank 0
stops them. The router only ever sees rank 0.

Failure: the group's collectives are bounded by parallel.timeout_s and rank 0 pings its
followers while idle, so a lost rank turns rank 0's health to not-alive within seconds (the
router then sends it nothing) and fails the requests in flight. The group is torn down as
a unit (stop_group) and a fresh one can be started in its place (Cluster.add_worker).
"""
from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from engine import EngineConfig, LLMEngine
from engine.parallel import ParallelConfig


@ray.remote
class RankActor:
    """Rank r > 0 of a group: its shard of the model, driven by rank 0's broadcasts."""

    def __init__(self, worker_id: str, engine_cfg: EngineConfig):
        self.worker_id = worker_id
        self.runner = LLMEngine(engine_cfg).runner
        self.thread = threading.Thread(target=self._follow, name=f"{worker_id}-follow", daemon=True)
        self.thread.start()

    def _follow(self) -> None:
        try:
            self.runner.follow()
        except Exception:
            pass  # kept in runner.error; health() reports it

    def health(self) -> dict:
        err = self.runner.error
        return {"worker_id": self.worker_id, "alive": self.thread.is_alive() and err is None,
                "error": repr(err) if err else None}


@ray.remote(num_cpus=0)
def _free_port(host: str) -> int:
    """A free port on the node this runs on (bundle 0's, where rank 0 hosts the store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Group:
    leader: object  # rank 0's actor handle
    ranks: list = field(default_factory=list)  # RankActor handles, ranks 1..k-1
    placement: PlacementGroup | None = None


def start_group(worker_id: str, start_leader: Callable[[EngineConfig, dict], object], engine_cfg: EngineConfig,
                tp: int, ep: int, bundle: dict, host: str, timeout_s: float = 60.0) -> Group:
    """Place k = max(tp, ep) ranks together (STRICT_PACK: one node, so the group's traffic stays
    local) and start them. `start_leader(rank 0's engine config, actor options)` starts rank 0."""
    world = max(tp, ep)
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK", name=f"{worker_id}-group")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        at = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
        port = ray.get(_free_port.options(scheduling_strategy=at(0)).remote(host))
        base = ParallelConfig(tp_size=tp, ep_size=ep, rendezvous=f"tcp://{host}:{port}", timeout_s=timeout_s)
        cfg = lambda r: engine_cfg.model_copy(update={"parallel": base.model_copy(update={"rank": r})})  # noqa: E731
        res = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
        ranks = [RankActor.options(**res, name=f"{worker_id}-rank{r}", scheduling_strategy=at(r)).remote(
            f"{worker_id}-rank{r}", cfg(r)) for r in range(1, world)]
        leader = start_leader(cfg(0), {**res, "scheduling_strategy": at(0)})
        group = Group(leader, ranks, pg)
        ray.get([leader.health.remote(), *[r.health.remote() for r in ranks]])  # surfaces a failed start
        return group
    except BaseException:
        remove_placement_group(pg)
        raise


def stop_group(group: Group) -> None:
    for r in group.ranks:
        ray.kill(r)
    if group.placement is not None:
        remove_placement_group(group.placement)
