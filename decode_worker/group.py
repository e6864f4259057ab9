"""A worker of TP (or EP) size k: k Ray actors placed together, one model split over them.

Rank 0 is the ordinary worker actor (DecodeActor or PrefillActor) whose engine holds a
ParallelModelRunner: it schedules, broadcasts each step's batch to the other ranks as int64
tensors over the group (engine.parallel.runner), samples and streams. Ranks 1..k-1 are
RankActors: they load their shard of the weights and run follow() on a thread until rank 0
stops them. The router only ever sees rank 0.

KV into a TP decode worker: every rank hosts its own TransferServer; rank 0's address() lists
them all, so a prefill worker opens one pair per rank (kv_transfer.reshard.connect_group) and
sends each rank exactly its heads. Rank 0's receiving thread for that pair takes its piece
(kv_transfer.decode_side), then one WRITE_LOCAL op has every other rank receive its piece from
the same prefill worker and write it. KV out
of a TP prefill worker is still gathered to its rank 0 (READ_KV) and leaves as all heads.

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
from engine.messages import WorkerHealth
from engine.parallel import ParallelConfig
from kv_transfer import KVLayout, KVTransferError, ReceiverChannel, TransferConfig, TransferServer
from kv_transfer.config import NODE_HOST
from kv_transfer.reshard import shard_of


@ray.remote
class RankActor:
    """Rank r > 0 of a group: its shard of the model, driven by rank 0's broadcasts."""

    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig | None = None):
        self.worker_id = worker_id
        engine = LLMEngine(engine_cfg)
        self.runner = engine.runner
        # A decode rank of a TP worker receives its own KV heads over its own pairs, one per
        # prefill worker, inside rank 0's WRITE_LOCAL (runner.receive_local).
        self.server = None
        self.channels: dict[str, ReceiverChannel] = {}
        if transfer_cfg is not None:
            heads = engine.model_config.num_kv_heads
            self.server = TransferServer(transfer_cfg.on_node(ray.util.get_node_ip_address()))
            self.layout = KVLayout.of_model(engine.model_id, self.runner.kv_cache, heads)
            self.shard = shard_of(heads, self.runner.plan.tp_size, self.runner.group.rank)
            self.runner.receive_local = self._receive
        self.thread = threading.Thread(target=self._follow, name=f"{worker_id}-follow", daemon=True)
        self.thread.start()

    def address(self) -> tuple[str, int]:
        return self.server.address

    def accept(self, ticket: str, expect: str | None = None) -> str:
        """Accept the pair of the prefill worker joining under `ticket` for this rank's heads
        (named `expect` when given); returns its id."""
        channel = self.server.accept(self.layout, self.shard, expect=expect, ticket=ticket)
        old = self.channels.pop(channel.peer, None)
        if old is not None:
            old.close()
        self.channels[channel.peer] = channel
        return channel.peer

    def disconnect(self, peer: str) -> None:
        """Close this rank's pair with a prefill worker that left the cluster."""
        channel = self.channels.pop(peer, None)
        if channel is not None:
            channel.close()

    def _receive(self, request_id: str, num_tokens: int, peer: str):
        channel = self.channels.get(peer)
        if channel is None:
            raise KVTransferError(f"{self.worker_id} has no pair with {peer!r}")
        header = channel.recv_header()
        if (header.request_id, header.num_tokens) != (request_id, num_tokens):  # before anything is allocated
            channel.refuse(header)
            raise KVTransferError(f"{self.worker_id} expected KV of {request_id!r} ({num_tokens} tokens), got "
                                  f"{header.request_id!r} ({header.num_tokens})")
        return channel.recv_payload(header)

    def _follow(self) -> None:
        try:
            self.runner.follow()
        except Exception:
            pass  # kept in runner.error; health() reports it

    def health(self) -> WorkerHealth:
        err = self.runner.error
        return WorkerHealth(self.worker_id, "rank", self.thread.is_alive() and err is None, repr(err) if err else None)


@ray.remote(num_cpus=0)
def _free_port(host: str) -> tuple[str, int]:
    """A free port on the node this runs on (bundle 0's, where rank 0 hosts the store); host
    "node" (kv_transfer.NODE_HOST) is that node's own address."""
    if host == NODE_HOST:
        host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        return host, s.getsockname()[1]


@dataclass
class Group:
    leader: object  # rank 0's actor handle
    ranks: list = field(default_factory=list)  # RankActor handles, ranks 1..k-1
    placement: PlacementGroup | None = None


def start_group(worker_id: str, start_leader: Callable[[EngineConfig, dict], object], engine_cfg: EngineConfig,
                tp: int, ep: int, bundle: dict, host: str, timeout_s: float = 60.0,
                receive_kv: TransferConfig | None = None) -> Group:
    """Place k = max(tp, ep) ranks together (STRICT_PACK: one node, so the group's traffic stays
    local) and start them. `start_leader(rank 0's engine config, actor options)` starts rank 0.
    With `receive_kv` (a decode worker with tp > 1) every rank receives its own KV heads over
    its own pairs, and rank 0 is told its ranks (attach_ranks)."""
    world = max(tp, ep)
    pg = placement_group([dict(bundle) for _ in range(world)], strategy="STRICT_PACK", name=f"{worker_id}-group")
    try:
        ray.get(pg.ready(), timeout=timeout_s)
        at = lambda i: PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)  # noqa: E731
        host, port = ray.get(_free_port.options(scheduling_strategy=at(0)).remote(host))
        base = ParallelConfig(tp_size=tp, ep_size=ep, rendezvous=f"tcp://{host}:{port}", timeout_s=timeout_s)
        cfg = lambda r: engine_cfg.model_copy(update={"parallel": base.model_copy(update={"rank": r})})  # noqa: E731
        res = {"num_cpus": bundle.get("CPU", 0), "num_gpus": bundle.get("GPU", 0)}
        per_rank = receive_kv if tp > 1 else None
        ranks = [RankActor.options(**res, name=f"{worker_id}-rank{r}", scheduling_strategy=at(r),
                                   max_concurrency=8).remote(f"{worker_id}-rank{r}", cfg(r), per_rank)
                 for r in range(1, world)]
        leader = start_leader(cfg(0), {**res, "scheduling_strategy": at(0)})
        group = Group(leader, ranks, pg)
        ray.get([leader.health.remote(), *[r.health.remote() for r in ranks]])  # surfaces a failed start
        if per_rank is not None:
            ray.get(leader.attach_ranks.remote(ranks))
        return group
    except BaseException:
        remove_placement_group(pg)
        raise


def stop_group(group: Group) -> None:
    for r in group.ranks:
        ray.kill(r)
    if group.placement is not None:
        remove_placement_group(group.placement)
