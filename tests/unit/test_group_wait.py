"""engine.parallel.group waits on collectives without a host timeout: the process group's own
timeout still bounds a collective a peer never joins, and the failed group is aborted."""
from __future__ import annotations

import os
import threading

import pytest
import torch

from engine.parallel import ParallelConfig
from engine.parallel.group import NCCL_ERROR_HANDLING, Group, GroupFailed, _env

CPU = torch.device("cpu")


def two_ranks(tmp_path, timeout_s: float) -> list[Group]:
    """A real two-rank gloo group, both ranks in this process (one thread each to connect)."""
    groups: list[Group | None] = [None, None]

    def join(rank: int) -> None:
        cfg = ParallelConfig(tp_size=2, rank=rank, rendezvous=f"file://{tmp_path}/store", timeout_s=timeout_s)
        groups[rank] = Group.create(cfg, CPU)

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(groups), "the two ranks did not connect"
    return groups


def test_collectives_work_and_a_missing_peer_fails_within_the_group_timeout(tmp_path):
    g0, g1 = two_ranks(tmp_path, timeout_s=2.0)
    results = []
    threads = [threading.Thread(target=lambda g=g: results.append(g.all_reduce(torch.ones(3)).tolist()))
               for g in (g0, g1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [[2.0] * 3] * 2
    # Rank 1 never joins this one: rank 0 fails (GroupFailed, not a hang) and aborts its group.
    with pytest.raises(GroupFailed, match="all_reduce on rank 0 of 2"):
        g0.all_reduce(torch.ones(3))
    assert g0.closed and g0.pg is None
    with pytest.raises(GroupFailed, match="closed"):
        g0.barrier()
    g1.close()


def test_the_nccl_error_policy_is_set_only_while_the_group_is_built():
    name, value = NCCL_ERROR_HANDLING
    assert value == "2"  # CleanUpOnly: abort the communicators, keep the process
    before = os.environ.get(name)
    with _env(name, value):
        assert os.environ[name] == "2"
    assert os.environ.get(name) == before


@pytest.mark.gpu
def test_a_one_rank_nccl_group_all_reduces(tmp_path):
    group = Group.create(ParallelConfig(rendezvous=f"file://{tmp_path}/store", backend="nccl"), torch.device("cuda"))
    try:
        t = group.all_reduce(torch.full((4,), 3.0, device="cuda"))
        assert t.tolist() == [3.0] * 4 and group.comm_calls == 2  # the barrier and this one
    finally:
        group.close()
    assert group.closed
