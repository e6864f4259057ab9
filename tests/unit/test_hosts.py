"""No socket of ours listens on every interface: every spelling of a wildcard is
refused wherever a host is configured, and the TP/EP group's store binds its rendezvous host
alone (torch's TCPStore, left to itself, listens on all of them)."""
from __future__ import annotations

import socket

import psutil
import pytest
from pydantic import ValidationError

from cluster.config import ClusterConfig
from engine.hosts import is_wildcard, listen_socket
from engine.parallel.config import ParallelConfig
from engine.parallel.group import make_store
from kv_transfer import TransferConfig

WILDCARDS = ["0.0.0.0", "0", "0.0", "00", "0x0", "000.000.000.000", "::", "[::]", "::0", "::ffff:0.0.0.0",
             "", "*", " 0.0.0.0 "]
SPECIFIC = ["127.0.0.1", "::1", "localhost", "10.1.2.3", "::ffff:127.0.0.1", "0177.0.0.1"]


@pytest.mark.parametrize("host", WILDCARDS)
def test_every_spelling_of_a_wildcard_is_refused(host: str) -> None:
    assert is_wildcard(host)
    with pytest.raises(ValidationError, match="every interface"):
        TransferConfig(host=host)
    with pytest.raises(ValidationError, match="wildcard"):
        ClusterConfig(host=host)
    with pytest.raises(ValueError, match="every interface"):
        listen_socket(host, [0])


@pytest.mark.parametrize("host", SPECIFIC)
def test_specific_addresses_pass(host: str) -> None:
    assert not is_wildcard(host)


def test_the_legacy_forms_really_are_the_wildcard_to_bind() -> None:
    """Why they are refused: the C library's parser reads "0x0" and "0.0" as 0.0.0.0."""
    for host in ("0x0", "0.0", "00", "000.000.000.000"):
        assert socket.inet_aton(host) == b"\0\0\0\0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening_ips(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_group_store_listens_on_the_rendezvous_host_only() -> None:
    port = _free_port()
    cfg = ParallelConfig(tp_size=2, rank=0, rendezvous=f"tcp://127.0.0.1:{port}", timeout_s=5)
    store = make_store(cfg)
    try:
        assert listening_ips(port) == {"127.0.0.1"}
        peer = make_store(cfg.model_copy(update={"rank": 1}))  # a rank still joins it
        peer.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        del store
    assert listening_ips(port) == set()


def test_a_wildcard_rendezvous_is_refused_before_anything_listens() -> None:
    port = _free_port()
    with pytest.raises(ValueError, match="every interface"):
        make_store(ParallelConfig(tp_size=2, rank=0, rendezvous=f"tcp://0.0.0.0:{port}", timeout_s=5))
    assert listening_ips(port) == set()
