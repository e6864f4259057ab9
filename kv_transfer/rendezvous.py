"""How a prefill/decode pair finds each other and builds its own process groups.

The receiving worker hosts one TCPStore (`TransferServer`). TCPStore binds every interface
when it opens its own socket, so the server binds a socket to the configured host itself
and hands the listening descriptor to the store (`master_listen_fd`).

Joining: a sender draws a pair number from the store's counter (`brigade-kv/joins`),
writes its name under `brigade-kv/join/<n>` and builds its groups under the prefix
`brigade-kv/pair/<n>/` as rank 1; `TransferServer.accept()` takes joins in order and
builds the same groups as rank 0. Pair numbers are never reused, so a worker can leave and
join again (a fresh number) while every other pair keeps running: no global group, no
restart. The store is used only while a pair is being built.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from kv_transfer.channel import ReceiverChannel, SenderChannel
from kv_transfer.config import TransferConfig
from kv_transfer.errors import ChannelClosed, KVTransferError, TransferTimeout
from kv_transfer.layout import HeadShard, KVLayout
from kv_transfer.pg_link import PGLink, gloo_group, nccl_group

_ROOT = "brigade-kv/"


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return backend


def _listen(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """A listening TCP socket bound to `host` only, on the first free port of the range."""
    ports = range(port_range[0], port_range[1] + 1) if port_range else [0]
    family, _, _, _, _ = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0]
    last: OSError | None = None
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))
            sock.listen(128)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise KVTransferError(f"cannot listen on {host} in ports {port_range}: {last}")


def _pair_link(store: dist.Store, n: int, rank: int, backend: str, config: TransferConfig) -> PGLink:
    prefix = f"{_ROOT}pair/{n}/"
    try:
        control = gloo_group(dist.PrefixStore(prefix + "gloo/", store), rank, config.host,
                             config.connect_timeout_s)
        data = (nccl_group(dist.PrefixStore(prefix + "nccl/", store), rank, config.timeout_s)
                if backend == "nccl" else None)
    except RuntimeError as e:
        raise TransferTimeout(f"pair {n} could not be built within {config.connect_timeout_s:g}s: {e}") from e
    return PGLink(control, data, config.timeout_s, store)


class TransferServer:
    """The receiving worker's rendezvous point: hosts the store, hands out one
    ReceiverChannel per joining sender. Owns the store; channels it returned live on after
    close(). accept() is called from one thread at a time."""

    def __init__(self, config: TransferConfig):
        self.config = config
        self.backend = resolve_backend(config.backend)
        sock = _listen(config.host, config.port_range)
        self.host, self.port = config.host, sock.getsockname()[1]
        # The store takes ownership of the descriptor and closes it with itself.
        timeout = timedelta(seconds=config.connect_timeout_s)
        self.store = dist.TCPStore(self.host, self.port, None, True, timeout, wait_for_workers=False,
                                   master_listen_fd=sock.detach())
        self.store.set(_ROOT + "backend", self.backend)
        # Pairs rendezvous through a client connection, so the groups they keep referencing
        # never pin the server: close() really stops listening while pairs live on.
        self._client = dist.TCPStore(self.host, self.port, None, False, timeout)
        self._next = 1

    @property
    def address(self) -> tuple[str, int]:
        """What a sender passes to `connect`."""
        return self.host, self.port

    def accept(self, layout: KVLayout, shard: HeadShard | None = None,
               timeout_s: float | None = None) -> ReceiverChannel:
        """Wait for the next sender to join and build the pair (rank 0). TransferTimeout if none
        joins in time; the slot is kept, so a later accept() waits for the same sender."""
        if self.store is None:
            raise ChannelClosed("transfer server is closed")
        timeout = timeout_s or self.config.connect_timeout_s
        key = f"{_ROOT}join/{self._next}"
        try:
            self.store.wait([key], timedelta(seconds=timeout))
        except RuntimeError as e:
            raise TransferTimeout(f"no sender joined within {timeout:g}s") from e
        n, self._next = self._next, self._next + 1
        peer = self.store.get(key).decode("utf-8")
        return ReceiverChannel(_pair_link(self._client, n, 0, self.backend, self.config), layout, shard, peer)

    def close(self) -> None:
        """Stop accepting joins: closes the listening socket; accepted channels keep working."""
        self.store = self._client = None


def connect(address: tuple[str, int], layout: KVLayout, config: TransferConfig, name: str,
            shard: HeadShard | None = None) -> SenderChannel:
    """Join the receiver at `address` as a sender named `name` (rank 1 of a new pair). Blocks
    until the receiver accepts, at most config.connect_timeout_s."""
    host, port = address
    timeout = timedelta(seconds=config.connect_timeout_s)
    try:
        store = dist.TCPStore(host, port, None, False, timeout)
        remote = store.get(_ROOT + "backend").decode("utf-8")
    except RuntimeError as e:
        raise TransferTimeout(f"no transfer server at {host}:{port} within "
                              f"{config.connect_timeout_s:g}s: {e}") from e
    backend = remote if config.backend == "auto" else config.backend
    if backend != remote:
        raise KVTransferError(f"backend {backend} here, the receiver at {host}:{port} uses {remote}")
    n = store.add(_ROOT + "joins", 1)
    store.set(f"{_ROOT}join/{n}", name.encode("utf-8"))
    return SenderChannel(_pair_link(store, n, 1, backend, config), layout, shard, name)
