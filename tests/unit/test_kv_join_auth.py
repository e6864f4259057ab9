"""The KV rendezvous is closed to strangers: the pairing's ticket reaches both sides from the
router, never through the store; a join needs the cluster's secret and the name the router
told the receiver to expect; a sender heeds only verdicts that carry the secret too. Whatever
a stranger who reaches the store's port writes, lists or bumps there, the real pair still
forms, now and at every later pairing. Real TransferServer, TCPStore and gloo pairs, both ends
in this process on threads, the stranger a store client of its own."""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from support import wait_for

from engine.hosts import listen_socket
from kv_transfer import (
    KVLayout,
    KVTransferError,
    TransferConfig,
    TransferServer,
    TransferTimeout,
    connect,
    new_ticket,
)

pytestmark = pytest.mark.timeout(120)

LAYOUT = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
CLUSTER = TransferConfig(timeout_s=20.0, connect_timeout_s=20.0, backend="gloo").with_secret()
STRANGER = TransferConfig(timeout_s=20.0, connect_timeout_s=20.0, backend="gloo").with_secret("not-the-secret")


def make_kv(num_tokens: int) -> torch.Tensor:
    nb = -(-num_tokens // LAYOUT.block_size)
    shape = (2, LAYOUT.num_layers, nb, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(num_tokens))


def stranger_at(server: TransferServer) -> dist.TCPStore:
    """A client of the server's store, as anyone who reaches its port can open."""
    host, port = server.address
    return dist.TCPStore(host, port, None, False, timedelta(seconds=10))


def keys_of(store: dist.TCPStore, ending: str) -> list[str]:
    """The keys a stranger finds by listing the store: pairs' keys are not hidden from it."""
    return sorted(k for k in store.list_keys() if k.startswith("brigade-kv/pair/") and k.endswith(ending))


def moves_kv(rx, tx, peer: str = "prefill-0") -> None:
    """The pair is real: one request's KV goes across it intact. Closes both ends."""
    try:
        assert rx.peer == peer
        kv = make_kv(10)
        sending = threading.Thread(target=tx.send, args=("req-1", kv, 10))
        sending.start()
        header, got = rx.receive()
        sending.join(30)
        assert header.request_id == "req-1" and torch.equal(got, kv)
    finally:
        rx.close()
        tx.close()


def pair(server: TransferServer, ticket: str, name: str = "prefill-0") -> None:
    """What the router does: accept and connect under one fresh ticket, at once; the pair must form."""
    with ThreadPoolExecutor(2) as pool:
        accepted = pool.submit(server.accept, LAYOUT, None, 20.0, name, ticket=ticket)
        sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, name, ticket=ticket)
        rx, tx = accepted.result(timeout=60), sender.result(timeout=60)
    moves_kv(rx, tx, name)


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


def test_a_stranger_bumping_the_join_counters_holds_up_no_pair() -> None:
    """A counter bumped with nothing written behind it: the server-wide one of older versions,
    and the pairing's own (found by listing the store), whose first slot then stays empty."""
    server = TransferServer(CLUSTER)
    stranger = stranger_at(server)
    try:
        stranger.add("brigade-kv/joins", 1)
        ticket = new_ticket()
        with ThreadPoolExecutor(2) as pool:
            accepted = pool.submit(server.accept, LAYOUT, None, 20.0, "prefill-0", ticket=ticket)
            (counter,) = wait_for(lambda: keys_of(stranger, "/joins"), 20, "the pairing's counter in the store")
            assert stranger.add(counter, 1) == 1  # slot 1 drawn, never written
            sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, "prefill-0", ticket=ticket)
            rx, tx = accepted.result(timeout=60), sender.result(timeout=60)
        moves_kv(rx, tx)
        assert keys_of(stranger, "/join/2") and not keys_of(stranger, "/join/1")  # the real join: slot 2
        stranger.add("brigade-kv/joins", 5)
        pair(server, new_ticket())  # and every later pairing of this server forms too
    finally:
        server.close()


def test_a_stranger_overwriting_the_rendezvous_keys_holds_up_no_pair() -> None:
    """The keys older versions read (the nonce, the backend, the first join and verdict slots)
    overwritten: the pairs of this server's whole life still form."""
    server = TransferServer(CLUSTER)
    stranger = stranger_at(server)
    try:
        for key, value in [("brigade-kv/nonce", "stranger"), ("brigade-kv/backend", "nccl"),
                           ("brigade-kv/join/1", json.dumps({"name": "prefill-0", "mac": "0" * 64})),
                           ("brigade-kv/verdict/1", json.dumps({"ok": False}))]:
            stranger.set(key, value)
        pair(server, new_ticket())
        stranger.set("brigade-kv/nonce", "again")
        pair(server, new_ticket())
    finally:
        server.close()


def test_a_forged_verdict_is_ignored_and_the_real_pair_forms(caplog: pytest.LogCaptureFixture) -> None:
    """A stranger who lists the store sees the join and answers it first: a refusal without the
    receiver's HMAC, then one with a made-up HMAC. The sender heeds neither."""
    caplog.set_level(logging.WARNING, logger="kv_transfer.rendezvous")
    server = TransferServer(CLUSTER)
    stranger = stranger_at(server)
    ticket = new_ticket()
    try:
        with ThreadPoolExecutor(1) as pool:
            sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, "prefill-0", ticket=ticket)
            (join,) = wait_for(lambda: keys_of(stranger, "/join/1"), 20, "the sender's join in the store")
            verdict = join.replace("/join/", "/verdict/")
            stranger.set(verdict, json.dumps({"ok": False, "backend": "gloo"}))
            wait_for(lambda: "ignored a verdict" in caplog.text, 20, "the sender ignoring the forged verdict")
            stranger.set(verdict, json.dumps({"ok": False, "backend": "gloo", "mac": "0" * 64}))
            assert not sender.done()  # still waiting for the real verdict
            rx = server.accept(LAYOUT, None, 20.0, "prefill-0", ticket=ticket)
            tx = sender.result(timeout=60)
        moves_kv(rx, tx)
    finally:
        server.close()


def test_a_rogue_join_under_a_workers_name_is_refused_and_the_real_pair_forms() -> None:
    """Joins under the right ticket (say it leaked) without the secret, or under another name,
    are refused; the real join, after them, pairs. The refusal carries the cluster's HMAC: a
    sender with the secret believes it, one without cannot tell it from a stranger's."""
    server = TransferServer(CLUSTER)
    ticket = new_ticket()
    try:
        with ThreadPoolExecutor(2) as pool:
            accepted = pool.submit(server.accept, LAYOUT, None, 20.0, "prefill-0", ticket=ticket)
            with pytest.raises(TransferTimeout, match="does not hold the cluster's secret"):  # the name, not the secret
                connect(server.address, LAYOUT, STRANGER.model_copy(update={"connect_timeout_s": 2.0}), "prefill-0",
                        ticket=ticket)
            with pytest.raises(KVTransferError, match="refused the join"):
                connect(server.address, LAYOUT, CLUSTER, "prefill-1", ticket=ticket)  # the secret, not the name
            with pytest.raises(KVTransferError, match="backend nccl here, the receiver at .* uses gloo"):
                connect(server.address, LAYOUT, CLUSTER.model_copy(update={"backend": "nccl"}), "prefill-0",
                        ticket=ticket)
            sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, "prefill-0", ticket=ticket)
            rx, tx = accepted.result(timeout=60), sender.result(timeout=60)
        moves_kv(rx, tx)
    finally:
        server.close()


def test_a_forged_or_replayed_join_record_is_refused_and_the_real_pair_forms() -> None:
    """Written straight into the pairing's slots, as a stranger who lists the store would: a
    real join record copied from an earlier pairing, a made-up one, bytes that are no JSON, JSON
    nested too deep to parse."""
    server = TransferServer(CLUSTER)
    stranger = stranger_at(server)
    try:
        pair(server, new_ticket())
        (old_join,) = keys_of(stranger, "/join/1")
        ticket = new_ticket()
        with ThreadPoolExecutor(2) as pool:
            accepted = pool.submit(server.accept, LAYOUT, None, 20.0, "prefill-0", ticket=ticket)
            old_counter = old_join.removesuffix("join/1") + "joins"
            counter = wait_for(lambda: [k for k in keys_of(stranger, "/joins") if k != old_counter], 20,
                               "the new pairing's counter")[0]
            prefix = counter.removesuffix("joins")
            forged = [stranger.get(old_join), json.dumps({"name": "prefill-0", "backend": "gloo", "mac": "0" * 64}),
                      b"\xff not json", "[" * 100_000 + "]" * 100_000]
            for record in forged:
                stranger.set(f"{prefix}join/{stranger.add(counter, 1)}", record)
            for slot in (1, 2, 3, 4):  # each refused, in a verdict its own sender could check
                wait_for(lambda s=slot: stranger.check([f"{prefix}verdict/{s}"]), 20, f"the verdict on slot {slot}")
                assert json.loads(stranger.get(f"{prefix}verdict/{slot}"))["ok"] is False
            sender = pool.submit(connect, server.address, LAYOUT, CLUSTER, "prefill-0", ticket=ticket)
            rx, tx = accepted.result(timeout=60), sender.result(timeout=60)
        moves_kv(rx, tx)
        with pytest.raises(ValueError, match="fresh one"):
            server.accept(LAYOUT, ticket=ticket)  # a ticket pairs once
        with pytest.raises(ValueError, match="ticket"):
            connect(server.address, LAYOUT, CLUSTER, "prefill-0", ticket="short")
    finally:
        server.close()


def test_a_sender_does_not_join_a_receiver_without_the_secret() -> None:
    """A stranger's store at the address: it answers the join "ok", but cannot prove it."""
    sock = listen_socket("127.0.0.1", [0])
    fake = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, timedelta(seconds=10),
                         wait_for_workers=False, master_listen_fd=sock.detach())
    impatient = CLUSTER.model_copy(update={"connect_timeout_s": 3.0})
    with ThreadPoolExecutor(1) as pool:
        sender = pool.submit(connect, ("127.0.0.1", fake.port), LAYOUT, impatient, "prefill-0", ticket=new_ticket())
        (join,) = wait_for(lambda: keys_of(fake, "/join/1"), 20, "the sender's join")
        fake.set(join.replace("/join/", "/verdict/"), json.dumps({"ok": True, "backend": "gloo", "mac": "f" * 64}))
        with pytest.raises(TransferTimeout, match="does not hold the cluster's secret"):
            sender.result(timeout=60)
