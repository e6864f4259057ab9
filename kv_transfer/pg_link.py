"""A Link over a 2-rank torch.distributed pair, and the raw send/recv baseline.

Each pair builds its own process groups directly on a store (never the global default
group), so pairs come and go independently:
- control: ProcessGroupGloo carrying header and ack (CPU tensors), and the payload when the
  backend is gloo. Its device is created on the configured host, so gloo's pair sockets
  listen on that address only.
- data (backend nccl only): ProcessGroupNCCL carrying the payload between CUDA tensors.
  NCCL's own bootstrap picks its interface from NCCL_SOCKET_IFNAME (set it to `lo` on a
  single host); that is outside this code's control.
"""
from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

from kv_transfer.base import Msg
from kv_transfer.errors import ChannelClosed, TransferTimeout

RAW_TAG = 100  # raw baseline messages; distinct from the Msg tags


def gloo_group(store: dist.Store, rank: int, host: str, timeout_s: float) -> dist.ProcessGroup:
    """A 2-rank gloo group on `store`, its sockets bound to `host`. Blocks until the peer joins."""
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timedelta(seconds=timeout_s)
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def nccl_group(store: dist.Store, rank: int, timeout_s: float) -> dist.ProcessGroup:
    """A 2-rank NCCL group on `store`, connected eagerly on the current CUDA device (a one-element
    exchange), so setup failures surface here rather than in the first transfer."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise RuntimeError("backend nccl needs CUDA and a torch build with NCCL")
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=timeout_s)
    pg = dist.ProcessGroupNCCL(store, rank, 2, opts)
    probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    work = pg.send([probe], 1 - rank, 0) if rank else pg.recv([probe], 1 - rank, 0)
    work.wait()
    torch.cuda.synchronize()
    return pg


def _complete(start: Callable[[], dist.Work], timeout_s: float, what: str) -> None:
    """Post one operation and wait for it; gloo may fail either step once the peer is gone."""
    try:
        start().wait(timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "timed out" in str(e).lower():
            raise TransferTimeout(f"{what} did not complete within {timeout_s:g}s; channel closed") from e
        raise ChannelClosed(f"{what} failed, the peer closed or crashed: {e}") from e


def raw_send(pg: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float = 60.0) -> None:
    """Baseline for benchmarks: a plain send of `tensor` to the other rank of a 2-rank group."""
    _complete(lambda: pg.send([tensor], 1 - pg.rank(), RAW_TAG), timeout_s, "raw send")


def raw_recv(pg: dist.ProcessGroup, tensor: torch.Tensor, timeout_s: float = 60.0) -> None:
    """Baseline for benchmarks: a plain receive into `tensor` from the other rank of a 2-rank group."""
    _complete(lambda: pg.recv([tensor], 1 - pg.rank(), RAW_TAG), timeout_s, "raw recv")


class PGLink:
    """base.Link over one pair's process groups. Owns the groups (and keeps the store client
    alive while they live); closes them on close() or on the first failure."""

    def __init__(self, control: dist.ProcessGroup, data: dist.ProcessGroup | None, timeout_s: float,
                 store: dist.Store | None = None):
        self.control = control
        self.data = data or control
        self.timeout_s = timeout_s
        self.peer = 1 - control.rank()
        self.payload_device = (torch.device("cuda", torch.cuda.current_device()) if data is not None
                               else torch.device("cpu"))
        self._store = store
        self.closed = False

    def send(self, tensor: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None:
        self._run(lambda pg: pg.send([tensor], self.peer, int(kind)), kind, "send", timeout_s)

    def recv(self, out: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None:
        self._run(lambda pg: pg.recv([out], self.peer, int(kind)), kind, "recv", timeout_s)

    def _run(self, start: Callable[[dist.ProcessGroup], dist.Work], kind: Msg, verb: str,
             timeout_s: float | None) -> None:
        if self.closed:
            raise ChannelClosed("link is closed")
        pg = self.data if kind is Msg.PAYLOAD else self.control
        try:
            _complete(lambda: start(pg), timeout_s or self.timeout_s, f"{verb} {kind.name.lower()}")
        except ChannelClosed:
            self.close()
            raise

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for pg in {id(self.control): self.control, id(self.data): self.data}.values():
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already torn down by a peer failure
        # shutdown() alone leaves gloo's pair sockets open; the peer notices the close only
        # once the group is destroyed, so drop every reference now.
        self.control = self.data = self._store = None
