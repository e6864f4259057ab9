"""The KV rendezvous is closed to strangers (issue 17): a join needs the cluster's secret and
the name the router told the receiver to expect; a sender checks the receiver holds the
secret too. Real TransferServer and gloo pairs, both ends in this process on threads."""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine.hosts import listen_socket
from kv_transfer import KVLayout, KVTransferError, TransferConfig, TransferServer, TransferTimeout, connect

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
CLUSTER = TransferConfig(timeout_s=20.0, connect_timeout_s=20.0, backend="gloo").with_secret()
STRANGER = TransferConfig(timeout_s=20.0, connect_timeout_s=20.0, backend="gloo").with_secret("not-the-secret")


def make_kv(num_tokens: int) -> torch.Tensor:
    nb = -(-num_tokens // LAYOUT.block_size)
    shape = (2, LAYOUT.num_layers, nb, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(num_tokens))


def test_the_secret_is_random_per_cluster_and_never_printed() -> None:
    a, b = TransferConfig().with_secret(), TransferConfig().with_secret()
    assert a.auth_key.get_secret_value() != b.auth_key.get_secret_value()
    assert a.with_secret() is a  # set once, kept
    secret = a.auth_key.get_secret_value()
    assert secret not in repr(a) and "auth_key" not in a.model_dump() and secret not in a.model_dump_json()
    node = TransferConfig(host="node").with_secret()
    assert node.on_node("10.0.0.9").auth_key == node.auth_key  # the copy each worker makes keeps it
    assert TransferConfig() == TransferConfig()  # configs without one still compare equal
    with pytest.raises(ValueError):
        TransferConfig(auth_key="from-a-file")  # no file or flag can set it


def test_a_rogue_join_under_a_workers_name_is_refused_and_the_real_pair_forms() -> None:
    server = TransferServer(CLUSTER)
    with ThreadPoolExecutor(2) as pool:
        accepted = pool.submit(server.accept, LAYOUT, None, 20.0, "prefill-0")
        with pytest.raises(KVTransferError, match="refused the join"):
            connect(server.address, LAYOUT, STRANGER, "prefill-0")  # the right name, not the secret
        with pytest.raises(KVTransferError, match="refused the join"):
            connect(server.address, LAYOUT, CLUSTER, "prefill-1")  # the secret, not the expected sender
        sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, "prefill-0")
        rx, tx = accepted.result(timeout=60), sender.result(timeout=60)
    try:
        assert rx.peer == "prefill-0"
        kv = make_kv(10)
        sending = threading.Thread(target=tx.send, args=("req-1", kv, 10))
        sending.start()
        header, got = rx.receive()
        sending.join(30)
        assert header.request_id == "req-1" and torch.equal(got, kv)
    finally:
        rx.close()
        tx.close()
        server.close()


def test_a_forged_join_record_is_refused() -> None:
    """Written straight into the store, as a stranger who can reach the port would."""
    server = TransferServer(CLUSTER)
    host, port = server.address
    store = dist.TCPStore(host, port, None, False, timedelta(seconds=10))
    n = store.add("brigade-kv/joins", 1)
    store.set(f"brigade-kv/join/{n}", json.dumps({"name": "prefill-0", "mac": "0" * 64}))
    with pytest.raises(TransferTimeout):
        server.accept(LAYOUT, timeout_s=1.0, expect="prefill-0")
    assert json.loads(store.get(f"brigade-kv/verdict/{n}")) == {"ok": False}
    store.set("brigade-kv/join/99", b"\xff not json")  # garbage in a later slot is no crash either
    server.close()


def test_a_sender_refuses_a_receiver_without_the_secret() -> None:
    """A stranger's store at the address: it answers every join "ok", but cannot prove it."""
    sock = listen_socket("127.0.0.1", [0])
    fake = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, timedelta(seconds=10),
                         wait_for_workers=False, master_listen_fd=sock.detach())
    fake.set("brigade-kv/backend", "gloo")
    fake.set("brigade-kv/nonce", "stranger")
    fake.set("brigade-kv/verdict/1", json.dumps({"ok": True, "mac": "f" * 64}))
    with pytest.raises(KVTransferError, match="does not hold the cluster's secret"):
        connect(("127.0.0.1", fake.port), LAYOUT, CLUSTER, "prefill-0")
