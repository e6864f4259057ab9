"""A TCP fault proxy for the KV link, and the store wrapper that routes a gloo pair through it.

gloo's pair sockets are not configurable: each rank publishes its listening address (a raw
sockaddr inside an opaque blob) in the rendezvous store and the other rank connects to it.
`ProxiedStore` wraps one rank's store and rewrites the IPv4 address in every value that rank
publishes to point at a `FaultProxy` instead, which forwards to the real socket. The bytes
then really cross two TCP connections, and the proxy can delay, reset, truncate, duplicate
or flip them on the way (one armed fault at a time, at a byte offset counted from when it
was armed).
"""
from __future__ import annotations

import random
import socket
import struct
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from support import wait_for

TO_SERVER, TO_CLIENT = "to_server", "to_client"  # from the connecting rank, and back


@dataclass
class Fault:
    """What to do to one direction's bytes once `at` more bytes have passed (after arming).

    kind: "delay" (hold every chunk `delay_s` from then on), "reset" (RST both sockets),
    "truncate" (forward up to the offset, then close both sockets with FIN), "duplicate"
    (send the `length` bytes from the offset twice; within one received chunk), "flip" (xor
    the byte at the offset with `mask`), "stall" (forward up to the offset, then nothing
    more, keeping the connections open).
    """

    kind: str
    at: int = 0
    from_rank: int = 1  # the bytes this rank sends (a KV pair's sender is rank 1)
    delay_s: float = 0.0
    length: int = 64
    mask: int = 0xFF


class FaultProxy:
    """Forwards one listening address on `host` to `target`, one connection pair per client."""

    def __init__(self, host: str, target: tuple[str, int], ports: list[int] | None = None, client_rank: int = -1):
        self.target, self.client_rank = target, client_rank
        self._listener = _listen(host, ports)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._passed = {TO_SERVER: 0, TO_CLIENT: 0}  # bytes since the fault was armed
        self.total = {TO_SERVER: 0, TO_CLIENT: 0}
        self.connections = 0
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def arm(self, fault: Fault | None) -> None:
        with self._lock:
            self._fault = fault
            self._passed = {TO_SERVER: 0, TO_CLIENT: 0}

    def direction(self, from_rank: int) -> str:
        """The direction carrying what `from_rank` sends."""
        return TO_SERVER if from_rank == self.client_rank else TO_CLIENT

    def sent_by(self, rank: int) -> int:
        """Bytes `rank` has sent through this proxy so far."""
        return self.total[self.direction(rank)]

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._sockets:
            _close(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            self.connections += 1
            threading.Thread(target=self._pump, args=(client, server, TO_SERVER), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, TO_CLIENT), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, direction: str) -> None:
        stalled = False
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                data = b""
            if not data:
                _close(dst)
                return
            if stalled:
                continue
            action, data, extra = self._apply(direction, bytearray(data))
            try:
                if action == "delay":
                    time.sleep(extra)
                dst.sendall(data)
            except OSError:
                _close(src)
                return
            if action == "reset":
                _reset(src), _reset(dst)
                return
            if action == "truncate":
                _close(src), _close(dst)
                return
            stalled = action == "stall"

    def _apply(self, direction: str, data: bytearray) -> tuple[str | None, bytes, object]:
        """(action, bytes to send now, extra) for one received chunk."""
        with self._lock:
            f = self._fault
            start = self._passed[direction]
            self._passed[direction] += len(data)
            self.total[direction] += len(data)
            if f is None or self.direction(f.from_rank) != direction or start + len(data) <= f.at:
                return None, bytes(data), None
            if f.kind == "delay":  # every chunk from the offset on
                return "delay", bytes(data), f.delay_s
            cut = max(0, f.at - start)  # offset of the fault inside this chunk
            self._fault = None  # the other kinds fire once
        if f.kind == "flip":
            data[cut] ^= f.mask
            return "flip", bytes(data), None
        if f.kind == "duplicate":
            end = cut + f.length
            return "duplicate", bytes(data[:end] + data[cut:end] + data[end:]), None
        return f.kind, bytes(data[:cut]), None  # reset, truncate, stall: the bytes before the offset


def sockaddr_port_offsets(value: bytes, host: str) -> list[int]:
    """Offsets of the port fields of the IPv4 sockaddrs on `host` inside an opaque blob (gloo
    publishes a rank's address so: family 2 in host order, then port and address in network order)."""
    needle = socket.inet_aton(host)
    found, at = [], value.find(needle)
    while at >= 4:
        if value[at - 4:at - 2] == b"\x02\x00":
            found.append(at - 2)
        at = value.find(needle, at + 1)
    return found


def gloo_ports(value: bytes, host: str) -> list[int]:
    """The ports of the gloo addresses on `host` in a published address blob."""
    return [int.from_bytes(value[i:i + 2], "big") for i in sockaddr_port_offsets(value, host)]


def _gloo_order(port: int) -> int:
    """The key gloo orders a pair's two ports by (gloo/transport/tcp/device.cc isInitiator: it
    subtracts the network-order sin_port fields as host integers, i.e. byte-swapped here)."""
    return ((port & 0xFF) << 8) | (port >> 8)


def _listen(host: str, ports: list[int] | range | None) -> socket.socket:
    """A listener on `host` at a random free port of `ports` (any port when None)."""
    if ports is None:
        return socket.create_server((host, 0))
    for port in random.sample(ports, min(len(ports), 200)):
        try:
            return socket.create_server((host, port))
        except OSError:
            continue
    raise OSError(f"no free port in {ports}")


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    s.close()


def _reset(s: socket.socket) -> None:
    """Close with RST rather than FIN (linger on, zero timeout)."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    s.close()


class ProxiedStore(dist.Store):
    """One rank's view of the rendezvous store, in which the peer's gloo address is a proxy's.

    Each value this rank reads that is not its own is searched for an IPv4 sockaddr (family
    2, then port and address in network order) on `host`; each one gets a FaultProxy and is
    rewritten to it. gloo picks which end of a pair connects by comparing the two addresses,
    so the proxy's port is chosen on the same side of this rank's own port (in gloo's order)
    as the peer's real one: the choice is unchanged, and the end that connects goes through
    its proxy.
    `proxies[i].client_rank` is this rank: the proxy's TO_SERVER direction is from it.
    """

    def __init__(self, inner: dist.Store, rank: int, host: str = "127.0.0.1"):
        super().__init__()
        self.inner, self.rank, self.host = inner, rank, host
        self._own: list[bytes] = []
        self.proxies: list[FaultProxy] = []

    def set(self, key: str, value) -> None:
        self._own.append(bytes(value))
        self.inner.set(key, value)

    def get(self, key):
        value = bytes(self.inner.get(key))
        return value if value in self._own else self._rewrite(value)

    def _rewrite(self, value: bytes) -> bytes:
        own = {port for v in self._own for port in gloo_ports(v, self.host)}
        out = bytearray(value)
        for i in sockaddr_port_offsets(value, self.host):
            port = int.from_bytes(out[i:i + 2], "big")
            # Same side of each of our own ports as the peer's real one, in gloo's order.
            same_side = [p for p in range(20000, 65000)
                         if all((_gloo_order(p) > _gloo_order(o)) == (_gloo_order(port) > _gloo_order(o)) for o in own)]
            proxy = FaultProxy(self.host, (self.host, port), same_side, self.rank)
            self.proxies.append(proxy)
            out[i:i + 2] = proxy.port.to_bytes(2, "big")
        return bytes(out)

    # the rest of the Store interface, unchanged
    def add(self, key, n):
        return self.inner.add(key, n)

    def wait(self, keys, timeout: timedelta | None = None):
        return self.inner.wait(keys) if timeout is None else self.inner.wait(keys, timeout)

    def check(self, keys):
        return self.inner.check(keys)

    def compare_set(self, key, expected, desired):
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key):
        return self.inner.delete_key(key)

    def num_keys(self):
        return self.inner.num_keys()

    def set_timeout(self, timeout):
        return self.inner.set_timeout(timeout)


def proxied_pair(n: int = 1, timeout_s: float = 1.0, host: str = "127.0.0.1"):
    """(sender link, receiver link, the proxy between them): a 2-rank gloo pair built as
    kv_transfer.rendezvous builds one (rank 1 sends), through a FaultProxy."""
    from kv_transfer import TransferConfig
    from kv_transfer.rendezvous import _listen, _pair_link

    # Bound to `host` only, as TransferServer does (a TCPStore opening its own socket binds every interface).
    server = dist.TCPStore(host, 0, None, True, timedelta(seconds=10), wait_for_workers=False,
                           master_listen_fd=_listen(host, None).detach())
    config = TransferConfig(host=host, timeout_s=timeout_s, connect_timeout_s=10.0)
    stores = [ProxiedStore(dist.TCPStore(host, server.port, None, False, timedelta(seconds=10)), r, host)
              for r in (0, 1)]
    links: dict[int, object] = {}

    def build(rank: int) -> None:
        links[rank] = _pair_link(stores[rank], f"brigade-kv/test-pair/{n}/", rank, "gloo", config)

    threads = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    used = wait_for(lambda: [p for st in stores for p in st.proxies if p.connections], 5,
                    "the pair connected through a proxy", 0.01)[0]
    for p in (p for st in stores for p in st.proxies if p is not used):
        p.close()
    used.keep = server  # the rendezvous store lives as long as the pair
    return links[1], links[0], used
