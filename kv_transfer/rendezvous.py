"""How a prefill/decode pair finds each other and builds its own process groups.

The receiving worker hosts one TCPStore (`TransferServer`). TCPStore binds every interface
when it opens its own socket, so the server binds a socket to the configured host itself
and hands the listening descriptor to the store (`master_listen_fd`).

Joining: the router makes a fresh random ticket for each pairing and hands it to both sides
over Ray, its own authenticated channel to its actors: `TransferServer.accept(ticket=...)`
on the decode worker, `connect(ticket=...)` on the prefill worker. Everything of that one
pairing lives under `brigade-kv/pair/<id>/`, `<id>` a hash of the ticket (the ticket itself
never enters the store): the sender draws a slot from that prefix's counter, writes its join
record in the slot, waits for the receiver's verdict on it and builds the pair's groups under
`<prefix><slot>/` as rank 1; accept() builds the same groups as rank 0. Nothing outside that
prefix is ever read, so what a stranger wrote anywhere else, or during an earlier pairing
(a bumped counter, an overwritten key), costs no later pair anything. A worker can leave and
join again (a new ticket) while every other pair keeps running: no global group, no restart.
The store is used only while a pair is being built.

Authentication: anyone who reaches the store's port may list, read and write its keys, so
no record is trusted for where it sits. A join counts only with an HMAC, under the cluster's
secret (`TransferConfig.auth_key`), over the ticket, the slot, the sender's name and its
backend; the receiver answers each join it reads with a verdict (accept or refuse) that
carries its own HMAC over the same, so a sender knows the receiver holds the secret and the
ticket, and ignores every verdict that does not (a forged refusal stops nothing). accept()
scans every slot up to the counter on each pass, so a slot drawn and never written, or
written with garbage, holds up no later one; a join under another name than the router's, a
forged or replayed one, or one without the secret is refused and the receiver goes on
looking for the real one. What remains open: someone who lists and overwrites the store's
keys while a pair is being built can make that one attempt fail (the router tries again, with
a fresh ticket, at its next health check), and the pair's own gloo groups are not
authenticated beyond this; the store and gloo listen on the transfer host only, which should
be a network only the cluster reaches.
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
_POLL_S = 0.02  # how often either side looks at the store again while a pair is being built
MAX_SLOTS = 64  # joins read per ticket: the real sender draws one of the first few
MIN_TICKET_CHARS = 16
log = logging.getLogger(__name__)


def new_ticket() -> str:
    """A fresh ticket for one pairing (what the router hands both sides)."""
    return secrets.token_urlsafe(16)


def _prefix(ticket: str) -> str:
    """Where one pairing's keys live: named by a hash, so listing the store shows no ticket."""
    if not (isinstance(ticket, str) and ticket.isascii() and len(ticket) >= MIN_TICKET_CHARS):
        raise ValueError(f"a pair's ticket is a random ASCII string of at least {MIN_TICKET_CHARS} characters "
                         "(kv_transfer.rendezvous.new_ticket), handed to both sides by the router")
    return f"{_ROOT}pair/{hashlib.sha256(ticket.encode()).hexdigest()[:32]}/"


def _mac(config: TransferConfig, ticket: str, slot: int, role: str, *fields: str) -> str:
    key = config.auth_key.get_secret_value().encode() if config.auth_key is not None else b""
    return hmac.new(key, json.dumps([ticket, slot, role, *fields]).encode(), hashlib.sha256).hexdigest()


def _record(raw: bytes) -> dict | None:
    """A JSON object from the store, or None for anything else (a stranger may write any bytes)."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError included; RecursionError: nested deep
        return None
    return value if isinstance(value, dict) else None


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


def _pair_link(store: dist.Store, prefix: str, rank: int, backend: str, config: TransferConfig) -> PGLink:
    try:
        control = gloo_group(dist.PrefixStore(prefix + "gloo/", store), rank, config.host,
                             config.connect_timeout_s)
        data = (nccl_group(dist.PrefixStore(prefix + "nccl/", store), rank, config.timeout_s)
                if backend == "nccl" else None)
    except RuntimeError as e:
        raise TransferTimeout(f"the pair could not be built within {config.connect_timeout_s:g}s: {e}") from e
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
        # Pairs rendezvous through a client connection, so the groups they keep referencing
        # never pin the server: close() really stops listening while pairs live on.
        self._client = dist.TCPStore(self.host, self.port, None, False, timeout)
        self._used: set[str] = set()  # the prefixes of tickets accept() was given: each pairs once

    @property
    def address(self) -> tuple[str, int]:
        """What a sender passes to `connect`."""
        return self.host, self.port

    def accept(self, layout: KVLayout, shard: HeadShard | None = None, timeout_s: float | None = None,
               expect: str | None = None, *, ticket: str) -> ReceiverChannel:
        """Wait for the sender holding `ticket` to join with the cluster's secret (named
        `expect`, when given) and build the pair (rank 0). Every other join under the ticket is
        refused; TransferTimeout if the real one does not join in time. A ticket is good for
        one call: a retry needs a fresh one, as the router makes for each pairing."""
        if self.store is None:
            raise ChannelClosed("transfer server is closed")
        prefix = _prefix(ticket)
        if prefix in self._used:
            raise ValueError("this ticket was handed to accept() before: each pairing gets a fresh one")
        self._used.add(prefix)
        timeout = timeout_s or self.config.connect_timeout_s
        deadline = time.monotonic() + timeout
        judged: set[int] = set()
        while True:
            for slot in range(1, self._drawn(prefix) + 1):
                key = f"{prefix}join/{slot}"
                if slot in judged or not self.store.check([key]):
                    continue  # an empty slot is looked at again on the next pass, and holds up no other
                judged.add(slot)
                peer = self._verified(ticket, slot, self.store.get(key), expect)
                verdict = "accept" if peer is not None else "refuse"
                fields = (peer, self.backend) if peer is not None else (self.backend,)
                self.store.set(f"{prefix}verdict/{slot}", json.dumps(
                    {"ok": peer is not None, "backend": self.backend,
                     "mac": _mac(self.config, ticket, slot, verdict, *fields)}))
                if peer is not None:
                    link = _pair_link(self._client, f"{prefix}{slot}/", 0, self.backend, self.config)
                    return ReceiverChannel(link, layout, shard, peer)
            if time.monotonic() >= deadline:
                raise TransferTimeout(f"no sender joined within {timeout:g}s" + (f" as {expect!r}" if expect else ""))
            time.sleep(_POLL_S)

    def _drawn(self, prefix: str) -> int:
        """How many slots of this pairing to look at: those drawn so far, at most MAX_SLOTS."""
        try:
            return max(0, min(int(self.store.add(prefix + "joins", 0)), MAX_SLOTS))
        except RuntimeError:  # a counter a stranger overwrote with something that is no number
            return MAX_SLOTS

    def _verified(self, ticket: str, slot: int, raw: bytes, expect: str | None) -> str | None:
        """The sender's name if the join in `slot` is genuine (and the one expected, with a
        backend this side runs); else None, logged."""
        join = _record(raw)
        name, backend, mac = (join.get(k) for k in ("name", "backend", "mac")) if join else (None,) * 3
        if not (isinstance(name, str) and isinstance(backend, str) and isinstance(mac, str)):
            log.warning("refused KV join %d: not a join record", slot)
            return None
        if not hmac.compare_digest(mac, _mac(self.config, ticket, slot, "join", name, backend)):
            log.warning("refused KV join %d under the name %.64r: it does not carry the cluster's secret and "
                        "this pairing's ticket", slot, name)
            return None
        if expect is not None and name != expect:
            log.warning("refused KV join %d from %.64r: expecting %.64r", slot, name, expect)
            return None
        if backend not in ("auto", self.backend):
            log.warning("refused KV join %d from %.64r: it runs %s, this receiver %s", slot, name, backend,
                        self.backend)
            return None
        return name

    def close(self) -> None:
        """Stop accepting joins: closes the listening socket; accepted channels keep working."""
        self.store = self._client = None


def connect(address: tuple[str, int], layout: KVLayout, config: TransferConfig, name: str,
            shard: HeadShard | None = None, *, ticket: str) -> SenderChannel:
    """Join the receiver at `address` as a sender named `name` (rank 1 of a new pair), under
    the `ticket` the router handed both sides. Blocks until the receiver accepts, at most
    config.connect_timeout_s."""
    prefix = _prefix(ticket)
    host, port = address
    deadline = time.monotonic() + config.connect_timeout_s
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=config.connect_timeout_s))
        slot = store.add(prefix + "joins", 1)
        if not 1 <= slot <= MAX_SLOTS:
            raise KVTransferError(f"the rendezvous at {host}:{port} handed out join slot {slot}: someone else "
                                  "writes to its store (the router pairs again with a fresh ticket)")
        store.set(f"{prefix}join/{slot}", json.dumps(
            {"name": name, "backend": config.backend,
             "mac": _mac(config, ticket, slot, "join", name, config.backend)}))
        ok, backend = _verdict(store, prefix, ticket, slot, config, name, deadline, f"{host}:{port}")
    except RuntimeError as e:
        raise TransferTimeout(f"the receiver at {host}:{port} did not answer the join within "
                              f"{config.connect_timeout_s:g}s: {e}") from e
    if config.backend not in ("auto", backend):
        raise KVTransferError(f"backend {config.backend} here, the receiver at {host}:{port} uses {backend}")
    if not ok:
        raise KVTransferError(f"the receiver at {host}:{port} refused the join of {name!r} (a different cluster's "
                              "secret, or it expected another sender)")
    return SenderChannel(_pair_link(store, f"{prefix}{slot}/", 1, backend, config), layout, shard, name)


def _verdict(store: dist.Store, prefix: str, ticket: str, slot: int, config: TransferConfig, name: str,
             deadline: float, where: str) -> tuple[bool, str]:
    """(accepted, the receiver's backend) from the first verdict on `slot` that carries the
    receiver's HMAC. Any other is ignored: a stranger can write the key, not forge the HMAC."""
    key, forged = f"{prefix}verdict/{slot}", False
    while True:
        if store.check([key]):
            verdict = _record(store.get(key)) or {}
            ok, backend, mac = verdict.get("ok"), verdict.get("backend"), str(verdict.get("mac"))
            if isinstance(backend, str) and ok is True and hmac.compare_digest(
                    mac, _mac(config, ticket, slot, "accept", name, backend)):
                return True, backend
            if isinstance(backend, str) and ok is False and hmac.compare_digest(
                    mac, _mac(config, ticket, slot, "refuse", backend)):
                return False, backend
            if not forged:
                log.warning("ignored a verdict on KV join %d at %s: it does not carry the cluster's secret",
                            slot, where)
                forged = True
        if time.monotonic() >= deadline:
            reason = ("it answered only with verdicts that do not carry the cluster's secret: the process there "
                      "does not hold the cluster's secret, not joining it") if forged else "no verdict came"
            raise TransferTimeout(f"the receiver at {where} did not accept the join of {name!r} within "
                                  f"{config.connect_timeout_s:g}s: {reason}")
        time.sleep(_POLL_S)
