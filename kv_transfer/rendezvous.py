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

Authentication: anyone who reaches the store's port may write to it, so a join counts only
with an HMAC, under the cluster's secret (`TransferConfig.auth_key`), over the store's
nonce, the pair number and the sender's name; the receiver answers each join with a verdict
(`brigade-kv/verdict/<n>`) that carries its own HMAC, so a sender knows the receiver holds
the secret too. The router tells the receiver which sender to expect: a join under another
name, a forged one, or one without the secret is refused and the receiver waits on for the
real one. The pair's own gloo groups are not authenticated beyond this; the store and gloo
listen on the transfer host only, which should be a network only the cluster reaches.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.hosts import listen_socket
from kv_transfer.channel import ReceiverChannel, SenderChannel
from kv_transfer.config import TransferConfig
from kv_transfer.errors import ChannelClosed, KVTransferError, TransferTimeout
from kv_transfer.layout import HeadShard, KVLayout
from kv_transfer.pg_link import PGLink, gloo_group, nccl_group

_ROOT = "brigade-kv/"
log = logging.getLogger(__name__)


def _mac(config: TransferConfig, nonce: str, n: int, role: str, name: str) -> str:
    key = config.auth_key.get_secret_value().encode() if config.auth_key is not None else b""
    return hmac.new(key, f"{nonce}|{n}|{role}|{name}".encode(), hashlib.sha256).hexdigest()


def resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    return backend


def _listen(host: str, port_range: tuple[int, int] | None) -> socket.socket:
    """A listening TCP socket bound to `host` only, on the first free port of the range."""
    ports = range(port_range[0], port_range[1] + 1) if port_range else [0]
    try:
        return listen_socket(host, ports)
    except OSError as e:
        raise KVTransferError(f"cannot listen on {host} in ports {port_range}: {e}") from e


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
        self._nonce = secrets.token_hex(16)  # kept here: the store's copy is only for senders to read
        self.store.set(_ROOT + "nonce", self._nonce)
        # Pairs rendezvous through a client connection, so the groups they keep referencing
        # never pin the server: close() really stops listening while pairs live on.
        self._client = dist.TCPStore(self.host, self.port, None, False, timeout)
        self._next = 1

    @property
    def address(self) -> tuple[str, int]:
        """What a sender passes to `connect`."""
        return self.host, self.port

    def accept(self, layout: KVLayout, shard: HeadShard | None = None,
               timeout_s: float | None = None, expect: str | None = None) -> ReceiverChannel:
        """Wait for the next sender to join with the cluster's secret (named `expect`, when
        given) and build the pair (rank 0). Other joins are refused and skipped. TransferTimeout
        if none joins in time; a slot nobody wrote yet is kept, so a later accept() waits for it."""
        if self.store is None:
            raise ChannelClosed("transfer server is closed")
        timeout = timeout_s or self.config.connect_timeout_s
        deadline = time.monotonic() + timeout
        while True:
            key = f"{_ROOT}join/{self._next}"
            try:
                self.store.wait([key], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError as e:
                raise TransferTimeout(f"no sender joined within {timeout:g}s"
                                      + (f" as {expect!r}" if expect else "")) from e
            n, self._next = self._next, self._next + 1
            peer = self._verified(n, self.store.get(key), expect)
            if peer is not None:
                self.store.set(f"{_ROOT}verdict/{n}", json.dumps(
                    {"ok": True, "mac": _mac(self.config, self._nonce, n, "accept", peer)}))
                return ReceiverChannel(_pair_link(self._client, n, 0, self.backend, self.config), layout, shard,
                                       peer)
            self.store.set(f"{_ROOT}verdict/{n}", json.dumps({"ok": False}))

    def _verified(self, n: int, raw: bytes, expect: str | None) -> str | None:
        """The sender's name if join `n` is genuine (and the one expected); else None, logged."""
        try:
            join = json.loads(raw)
            name, mac = join["name"], join["mac"]
            ok = isinstance(name, str) and isinstance(mac, str)
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok:
            log.warning("refused KV join %d: not a join record", n)
            return None
        if not hmac.compare_digest(mac, _mac(self.config, self._nonce, n, "join", name)):
            log.warning("refused KV join %d under the name %.64r: it does not carry the cluster's secret", n, name)
            return None
        if expect is not None and name != expect:
            log.warning("refused KV join %d from %.64r: expecting %.64r", n, name, expect)
            return None
        return name

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
    try:
        nonce = store.get(_ROOT + "nonce").decode("utf-8")
        n = store.add(_ROOT + "joins", 1)
        store.set(f"{_ROOT}join/{n}", json.dumps({"name": name, "mac": _mac(config, nonce, n, "join", name)}))
        store.wait([f"{_ROOT}verdict/{n}"])
        verdict = json.loads(store.get(f"{_ROOT}verdict/{n}"))
    except RuntimeError as e:
        raise TransferTimeout(f"the receiver at {host}:{port} did not answer the join within "
                              f"{config.connect_timeout_s:g}s: {e}") from e
    except ValueError as e:
        raise KVTransferError(f"the receiver at {host}:{port} answered the join with garbage") from e
    if not (isinstance(verdict, dict) and verdict.get("ok")):
        raise KVTransferError(f"the receiver at {host}:{port} refused the join of {name!r} (a different cluster's "
                              "secret, or it expected another sender)")
    if not hmac.compare_digest(str(verdict.get("mac")), _mac(config, nonce, n, "accept", name)):
        raise KVTransferError(f"the receiver at {host}:{port} does not hold the cluster's secret: not joining it")
    return SenderChannel(_pair_link(store, n, 1, backend, config), layout, shard, name)
