"""A process group of one engine's ranks, built directly on a store (never the global default
group, so a process may hold several and tear one down without touching the others).

gloo for CPU tensors, NCCL for CUDA ones. A rank that died makes the others fail with
GroupFailed instead of hanging, within `timeout_s`: the bound is the process group's own
timeout, never a timed host wait. (A timed `Work.wait` makes NCCL's host poll the work with
1 ms sleeps, so every all-reduce of a forward pass would cost at least a millisecond; an
untimed one only orders the current stream after the collective.) NCCL is built with the
"clean up only" error policy: its watchdog aborts the communicators of a collective past the
timeout, and the next collective (the keepalive's, if nothing else) raises, where NCCL's
default policy would kill the surviving process. What the host read from an aborted
collective is garbage: callers call check() after reading a result (the parallel runner
does, after each step and each op header).
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from engine.hosts import listen_socket
from engine.parallel.config import ParallelConfig

# TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (CleanUpOnly): on a timeout or an error the watchdog
# aborts the communicators and records the error; the process lives on.
NCCL_ERROR_HANDLING = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


class GroupFailed(RuntimeError):
    """A collective timed out or a peer rank is gone; the group is unusable and must be rebuilt."""


def make_store(cfg: ParallelConfig) -> dist.Store:
    url = urlparse(cfg.rendezvous)
    timeout = timedelta(seconds=cfg.timeout_s)
    if url.scheme == "file":
        store = dist.FileStore(url.path, cfg.world_size)
        store.set_timeout(timeout)
        return store
    host, port = url.hostname or "127.0.0.1", url.port or 29510
    if cfg.rank != 0:
        return dist.TCPStore(host, port, cfg.world_size, is_master=False, timeout=timeout)
    # TCPStore's own socket listens on every interface: bind the rendezvous host alone and
    # hand the store that descriptor.
    sock = listen_socket(host, [port])
    return dist.TCPStore(host, port, cfg.world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


class Group:
    """The collectives the parallel model and runner need, on `device`'s tensors."""

    def __init__(self, pg: dist.ProcessGroup, device: torch.device, timeout_s: float, store: dist.Store):
        self.pg, self.device, self.timeout_s = pg, device, timeout_s
        self.rank, self.size = pg.rank(), pg.size()
        self._store = store  # the group's sockets were set up through it; keep it alive as long
        self.closed = False
        # Seconds spent waiting in collectives (the transfer plus any wait for a slower rank),
        # and their count: benchmarks read these for the communication share of a step.
        self.comm_s, self.comm_calls = 0.0, 0
        self._last: dist.Work | None = None  # the last collective posted, for check()

    @classmethod
    def create(cls, cfg: ParallelConfig, device: torch.device) -> Group:
        store = make_store(cfg)
        timeout = timedelta(seconds=cfg.timeout_s)
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        if backend == "nccl":
            if not (device.type == "cuda" and dist.is_nccl_available()):
                raise ValueError("parallel.backend nccl needs a CUDA device and a torch build with NCCL")
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            with _env(*NCCL_ERROR_HANDLING):  # read once, by the constructor
                pg = dist.ProcessGroupNCCL(store, cfg.rank, cfg.world_size, opts)
        else:
            if device.type != "cpu":
                raise ValueError(f"parallel.backend gloo runs on CPU tensors, the device is {device}")
            opts = dist.ProcessGroupGloo._Options()
            # Bind gloo's pair sockets to the rendezvous host (the ranks share a node), never to
            # whatever interface the machine's hostname resolves to.
            host = urlparse(cfg.rendezvous).hostname or "127.0.0.1"
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
            opts._timeout = timeout
            pg = dist.ProcessGroupGloo(store, cfg.rank, cfg.world_size, opts)
        group = cls(pg, device, cfg.timeout_s, store)
        group.barrier()  # connect now, so a missing rank fails here and not mid-forward
        return group

    def all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._run(lambda: self.pg.allreduce([t], opts), "all_reduce")
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._run(lambda: self.pg.allgather([out], [t.contiguous()]), "all_gather")
        return out

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        self._run(lambda: self.pg.broadcast([t], opts), "broadcast")
        return t

    def scatter(self, out: torch.Tensor, chunks: list[torch.Tensor] | None, src: int = 0) -> torch.Tensor:
        """Rank `src` sends chunks[r] to rank r (its own included); every rank receives into `out`."""
        opts = dist.ScatterOptions()
        opts.rootRank = src
        inputs = [[c.contiguous() for c in chunks]] if self.rank == src else []
        self._run(lambda: self.pg.scatter([out], inputs, opts), "scatter")
        return out

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, device=self.device))

    def _run(self, post: Callable[[], dist.Work], what: str) -> None:
        """Post one collective and wait for it without a host timeout (see the module doc):
        gloo returns when the collective is done or has failed past its own timeout; NCCL
        returns at once, the current stream ordered after the collective (comm_s then counts
        only the host's share)."""
        if self.closed:
            raise GroupFailed("the group is closed")
        start = time.perf_counter()
        try:
            work = post()
            work.wait()
            self._last = work
        except RuntimeError as e:
            self.close(failed=True)
            raise GroupFailed(f"{what} on rank {self.rank} of {self.size} failed: {e}") from e
        self.comm_s += time.perf_counter() - start
        self.comm_calls += 1

    def check(self) -> None:
        """Call once the host has read a result of this group's collectives. On NCCL, what it
        reads after the watchdog aborted a collective past its timeout is garbage, and only
        the work's recorded error tells: GroupFailed then. (gloo's wait raised already.)"""
        work = self._last
        if self.device.type != "cuda" or work is None or self.closed:
            return
        error = work.exception()  # deprecated in torch, warns once; None while all is well
        if error is not None:
            self.close(failed=True)
            raise GroupFailed(f"a collective on rank {self.rank} of {self.size} failed: {error}")

    def close(self, failed: bool = False) -> None:
        """Release the group. After a failure its communicators are aborted: a graceful
        shutdown would wait for in-flight collectives that a dead peer never completes."""
        if self.closed:
            return
        self.closed = True
        try:
            self.pg.abort() if failed else self.pg.shutdown()
        except RuntimeError:
            pass  # already torn down by a peer failure
        self.pg = self._store = self._last = None


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Set one environment variable for the duration of the block, then restore it."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
