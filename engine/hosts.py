"""Listening addresses: refuse every spelling of "all interfaces", and bind to exactly one.

Shared by every socket Brigade opens for its own traffic (the TP/EP group store here, the
KV rendezvous in kv_transfer, the doors' --host), so one check decides what a wildcard is.
"""
from __future__ import annotations

import ipaddress
import socket


def is_wildcard(host: str) -> bool:
    """True for any spelling of "every interface": "", "*", 0.0.0.0 and what the C resolver
    also reads as it ("0", "0.0", "00", "0x0", "000.000.000.000"), "::", "[::]",
    "::ffff:0.0.0.0", or a name that resolves to one of those."""
    h = host.strip().strip("[]")
    if h in ("", "*"):
        return True
    try:
        address = ipaddress.ip_address(h.split("%", 1)[0])
    except ValueError:
        return _resolves_to_unspecified(h)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_unspecified or (mapped is not None and mapped.is_unspecified)


def _resolves_to_unspecified(h: str) -> bool:
    try:  # the legacy IPv4 forms (octal, hex, fewer than four parts) that bind() accepts
        return socket.inet_aton(h) == b"\0\0\0\0"
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # unresolvable: binding it fails later with its own error
        return False
    return any(is_wildcard(info[4][0]) for info in infos if info[4][0] != h)


def listen_socket(host: str, ports: range | list[int]) -> socket.socket:
    """A listening TCP socket bound to `host` only, on the first port of `ports` that is free
    (port 0: the OS picks). OSError (the last bind's) if none is."""
    if is_wildcard(host):
        raise ValueError(f"host {host!r} would listen on every interface; name one address")
    family = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][0]
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
    raise last or OSError(f"no port to listen on for {host}")
