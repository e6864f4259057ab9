"""kv_transfer: the wire header, checksums, the in-process pair, and real gloo pairs between
spawned processes (one receiver here, senders in child processes driven by commands)."""
from __future__ import annotations

import math
import multiprocessing as mp
import socket
import struct
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import psutil
import pytest
import torch

from kv_transfer import (
    HEADER_SIZE,
    MAX_ID_BYTES,
    ChannelClosed,
    ChecksumAlgo,
    ChecksumMismatch,
    DraftSection,
    HeaderError,
    KVLayout,
    KVTransferError,
    LayoutMismatch,
    RefuseReason,
    TransferConfig,
    TransferHeader,
    TransferRefused,
    TransferServer,
    TransferTimeout,
    check_draft,
    connect,
    decode_header,
    draft_model_key,
    encode_header,
    inprocess_pair,
    payload_checksum,
    payload_view,
)

LAYOUT = KVLayout("tiny", num_layers=2, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
CONFIG = TransferConfig(timeout_s=20.0, connect_timeout_s=30.0, backend="gloo")


def ticket_for(name: str) -> str:
    """The pairing's ticket, as the router would hand both sides: one per sender name, and each
    name pairs once with each server here."""
    return f"the-pairing-of-{name}"
WILDCARDS = {"0.0.0.0", "::"}


def make_kv(seed: int, num_tokens: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    """(2, L, nb, bs, H, D) random KV for `num_tokens` tokens, the same in every process."""
    nb = math.ceil(num_tokens / layout.block_size)
    shape = (2, layout.num_layers, nb, layout.block_size, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(layout.dtype)


def make_header(**overrides) -> TransferHeader:
    """A TP-shard header: heads [4, 8) of 8, bf16, 33 tokens in 3 blocks of 16."""
    fields = dict(request_id="req-1", model_id="tiny", num_layers=2, num_kv_heads=8, head_dim=64,
                  block_size=16, dtype=torch.bfloat16, num_tokens=33, num_blocks=3, tp_size=2, tp_rank=1,
                  head_start=4, head_count=4, payload_nbytes=2 * 2 * 3 * 16 * 4 * 64 * 2, checksum_algo=2,
                  checksum=0xFEDC_BA98_7654_3210)
    return TransferHeader(**(fields | overrides))


def listening_addresses(pid: int | None = None) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections("inet")
            if c.status == psutil.CONN_LISTEN}


# --- wire header ---------------------------------------------------------------------------------

def test_header_round_trip_is_exact():
    fp32 = dict(dtype=torch.float32, payload_nbytes=2 * 2 * 3 * 16 * 4 * 64 * 4)
    for header in (make_header(),
                   make_header(request_id="r" * MAX_ID_BYTES, model_id="Qwen/Qwen3-0.6B", **fp32),
                   make_header(request_id="запрос-é", checksum=(1 << 64) - 1)):
        data = encode_header(header)
        assert len(data) == HEADER_SIZE
        assert decode_header(data) == header
    data = encode_header(make_header())
    assert data[:8] == b"BRGDKVH\x00" and struct.unpack_from("<HH", data, 8) == (1, HEADER_SIZE)
    assert make_header().payload_shape == (2, 2, 3, 16, 4, 64)


DRAFT_LAYOUT = KVLayout("tiny-draft", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype=torch.float32)


def make_draft(**overrides) -> DraftSection:
    """The draft section of make_header()'s 33 tokens: 1 layer, 2 heads of 32, bf16."""
    fields = dict(model_key=draft_model_key("tiny-draft"), num_layers=1, num_kv_heads=2, head_dim=32,
                  dtype=torch.bfloat16, num_tokens=33, num_blocks=3, payload_nbytes=2 * 1 * 3 * 16 * 2 * 32 * 2,
                  checksum=0x0123_4567_89AB_CDEF)
    return DraftSection(**(fields | overrides))


def test_a_header_with_a_draft_section_is_version_2_and_round_trips():
    header = make_header(draft=make_draft())
    data = encode_header(header)
    assert struct.unpack_from("<H", data, 8) == (2,) and decode_header(data) == header
    assert header.draft.payload_shape(header.block_size) == (2, 1, 3, 16, 2, 32)
    # Without one it stays version 1: a decode worker from before draft KV still reads it.
    assert struct.unpack_from("<H", encode_header(make_header()), 8) == (1,)
    assert decode_header(encode_header(make_header())).draft is None


@pytest.mark.parametrize("overrides, message", [
    (dict(num_tokens=34, num_blocks=3), "1..33"),
    (dict(num_blocks=2), "need 3 blocks"),
    (dict(payload_nbytes=12), "draft_payload_nbytes"),
    (dict(num_layers=0), "draft layers"),
])
def test_a_draft_section_whose_counts_disagree_is_refused(overrides, message):
    with pytest.raises(HeaderError, match=message):
        make_header(draft=make_draft(**overrides))


@pytest.mark.parametrize("mangle, message", [
    (lambda d: d[:-1], "truncated"),
    (lambda d: d[:100], "truncated"),
    (lambda d: d + b"\x00", "expected 512"),
    (lambda d: b"NOTKVHDR" + d[8:], "bad magic"),
    (lambda d: d[:8] + struct.pack("<H", 3) + d[10:], "version 3"),
    (lambda d: d[:200] + bytes([d[200] ^ 1]) + d[201:], "crc32"),
])
def test_decode_rejects_bad_headers(mangle, message):
    with pytest.raises(HeaderError, match=message):
        decode_header(mangle(encode_header(make_header())))


def test_decode_rejects_a_well_formed_header_with_inconsistent_fields():
    data = bytearray(encode_header(make_header()))
    # num_blocks sits after magic/version/size, both ids and the five layout fields.
    offset = struct.calcsize("<8sHHH128sH128sIIIIHQ")
    struct.pack_into("<I", data, offset, 4)
    struct.pack_into("<I", data, HEADER_SIZE - 4, zlib.crc32(bytes(data[:HEADER_SIZE - 4])))
    with pytest.raises(HeaderError, match="need 3 blocks"):
        decode_header(bytes(data))


@pytest.mark.parametrize("overrides, message", [
    (dict(request_id="r" * (MAX_ID_BYTES + 1)), "request_id must be 1..128"),
    (dict(request_id="é" * 65), "request_id must be 1..128"),  # 130 UTF-8 bytes
    (dict(model_id="m" * 200), "model_id must be 1..128"),
    (dict(request_id=""), "request_id"),
    (dict(num_blocks=4), "need 3 blocks"),
    (dict(head_start=6), "outside 8 KV heads"),
    (dict(tp_rank=2), "tp_rank"),
    (dict(payload_nbytes=10), "payload_nbytes"),
    (dict(checksum_algo=9), "checksum algorithm"),
])
def test_header_refuses_bad_fields(overrides, message):
    with pytest.raises(HeaderError, match=message):
        make_header(**overrides)


# --- checksum ------------------------------------------------------------------------------------

@pytest.mark.parametrize("algo", list(ChecksumAlgo))
@pytest.mark.parametrize("nbytes", [4096, 4099])
def test_checksum_changes_when_one_byte_flips(algo, nbytes):
    data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    _, good = payload_checksum(data, algo)
    assert payload_checksum(data.clone(), algo) == (algo, good)
    for pos in (0, 1, nbytes // 2, nbytes - 1):
        bad = data.clone()
        bad[pos] ^= 0x01
        assert payload_checksum(bad, algo)[1] != good, pos
    assert payload_checksum(data[:-4], algo)[1] != payload_checksum(data, algo)[1]


def test_checksum_picks_xxh3_on_cpu_and_wsum32_matches_its_definition():
    t = torch.randn(1001)  # 4004 bytes
    assert payload_checksum(t)[0] is ChecksumAlgo.XXH3_64
    words = t.numpy().view(np.uint32).astype(np.uint64)
    weights = np.arange(words.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    expected = (int((words * weights).sum()) + 4004 * 0x9E3779B97F4A7C15) % (1 << 64)
    assert payload_checksum(t, ChecksumAlgo.WSUM32) == (ChecksumAlgo.WSUM32, expected)
    with pytest.raises(ValueError, match="contiguous"):
        payload_checksum(torch.randn(4, 4).t())


def test_config_refuses_wildcard_hosts_and_bad_port_ranges():
    for host in ("0.0.0.0", "::", ""):
        with pytest.raises(ValueError, match="every interface"):
            TransferConfig(host=host)
    with pytest.raises(ValueError, match="port_range"):
        TransferConfig(port_range=(9000, 8000))


# --- in-process pair (the same channel code over queues) -----------------------------------------

def run_sender(fn):
    """Run the sender half in a thread (it blocks on the ack); returns a Future."""
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn)
    pool.shutdown(wait=False)
    return future


def test_inprocess_pair_moves_kv_exactly():
    tx, rx = inprocess_pair(LAYOUT)
    kv = make_kv(1, 10)
    sent = run_sender(lambda: tx.send("a", kv, 10))
    header, got = rx.receive()
    assert sent.result(5) == header and header.num_tokens == 10 and header.num_blocks == 3
    assert torch.equal(got, kv)

    staging = torch.zeros(1 << 16, dtype=torch.uint8)  # reused across requests
    sent = run_sender(lambda: tx.send("b", make_kv(2, 6), 6))
    header = rx.recv_header()
    got = rx.recv_payload(header, payload_view(staging, header))
    assert got.data_ptr() == staging.data_ptr() and torch.equal(got, make_kv(2, 6))
    assert sent.result(5).request_id == "b"


def test_inprocess_refusals_leave_the_pair_usable():
    tx, rx = inprocess_pair(LAYOUT)
    sent = run_sender(lambda: tx.send("full", make_kv(2, 5), 5))
    rx.refuse(rx.recv_header(), RefuseReason.NO_CAPACITY)
    with pytest.raises(TransferRefused) as refused:
        sent.result(5)
    assert refused.value.reason is RefuseReason.NO_CAPACITY and tx.stats.payloads == 0

    rx.layout = replace(LAYOUT, model_id="other")
    sent = run_sender(lambda: tx.send("wrong-model", make_kv(2, 5), 5))
    with pytest.raises(LayoutMismatch, match="MODEL"):
        rx.recv_header()
    with pytest.raises(TransferRefused, match="MODEL"):
        sent.result(5)

    rx.layout = LAYOUT
    sent = run_sender(lambda: tx.send("ok", make_kv(3, 5), 5))
    assert torch.equal(rx.receive()[1], make_kv(3, 5))
    sent.result(5)
    assert (tx.stats.refused, tx.stats.payloads, rx.stats.refused, rx.stats.payloads) == (2, 1, 2, 1)


def test_inprocess_corrupted_payload_is_rejected_and_the_pair_stays_usable():
    tx, rx = inprocess_pair(LAYOUT)
    tx.corrupt_next_payload = True
    kv = make_kv(4, 7)
    sent = run_sender(lambda: tx.send("bad", kv, 7))
    with pytest.raises(ChecksumMismatch, match="'bad'"):
        rx.receive()
    sent.result(5)
    assert torch.equal(kv, make_kv(4, 7))  # the hook corrupts a copy, never the caller's tensor
    run_sender(lambda: tx.send("good", kv, 7))
    assert torch.equal(rx.receive()[1], kv)


def draft_pair():
    tx, rx = inprocess_pair(LAYOUT)
    tx.draft_layout = rx.draft_layout = DRAFT_LAYOUT
    return tx, rx


def test_inprocess_pair_moves_draft_kv_with_the_target_kv():
    tx, rx = draft_pair()
    kv, draft = make_kv(1, 10), make_kv(2, 10, DRAFT_LAYOUT)
    sent = run_sender(lambda: tx.send("a", kv, 10, draft_kv=draft))
    header = rx.recv_header()
    assert header.draft.num_tokens == 10 and header.draft.num_blocks == 3
    assert check_draft(header, DRAFT_LAYOUT) is None
    assert "another draft model" in check_draft(header, replace(DRAFT_LAYOUT, model_id="other"))
    draft_out = rx.draft_buffer(header)
    got = rx.recv_payload(header, draft_out=draft_out)
    assert torch.equal(got, kv) and torch.equal(draft_out, draft) and sent.result(5) == header
    assert tx.stats.payloads == rx.stats.payloads == 2

    # Declined (no room for it): only the target's KV comes; the pair stays in step.
    sent = run_sender(lambda: tx.send("b", kv, 10, draft_kv=draft))
    assert torch.equal(rx.recv_payload(rx.recv_header()), kv)
    sent.result(5)
    assert tx.stats.payloads == rx.stats.payloads == 3
    run_sender(lambda: tx.send("c", make_kv(3, 5), 5))
    assert torch.equal(rx.receive()[1], make_kv(3, 5))


def test_inprocess_corrupted_draft_payload_is_rejected_and_the_pair_stays_usable():
    tx, rx = draft_pair()
    kv, draft = make_kv(4, 7), make_kv(5, 7, DRAFT_LAYOUT)
    tx.corrupt_next_draft_payload = True
    sent = run_sender(lambda: tx.send("bad", kv, 7, draft_kv=draft))
    header = rx.recv_header()
    with pytest.raises(ChecksumMismatch, match="'bad': draft payload"):
        rx.recv_payload(header, draft_out=rx.draft_buffer(header))
    sent.result(5)
    assert rx.stats.checksum_failures == 1
    run_sender(lambda: tx.send("good", kv, 7, draft_kv=draft))
    header = rx.recv_header()
    out = rx.draft_buffer(header)
    assert torch.equal(rx.recv_payload(header, draft_out=out), kv) and torch.equal(out, draft)


def test_inprocess_sender_checks_its_own_layout():
    tx, _ = inprocess_pair(LAYOUT)
    with pytest.raises(LayoutMismatch, match="SHAPE"):
        tx.send("a", make_kv(5, 12), 5)  # 3 blocks for 5 tokens
    with pytest.raises(LayoutMismatch, match="DTYPE"):
        tx.send("a", make_kv(5, 5).half(), 5)


def test_inprocess_receiver_times_out_within_the_configured_timeout():
    _, rx = inprocess_pair(LAYOUT, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="0.3s"):
        rx.recv_header()
    assert time.monotonic() - start < 2.0
    with pytest.raises(ChannelClosed):
        rx.recv_header()


def test_server_binds_the_configured_host_within_the_port_range():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(KVTransferError, match="cannot listen"):
            TransferServer(CONFIG.model_copy(update={"port_range": (port, port)}))
    server = TransferServer(CONFIG.model_copy(update={"port_range": (port, port)}))  # free again
    assert server.address == ("127.0.0.1", port) and ("127.0.0.1", port) in listening_addresses()
    server.close()
    assert ("127.0.0.1", port) not in listening_addresses()


def test_accept_times_out_when_no_sender_joins():
    server = TransferServer(CONFIG)
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="no sender joined"):
        server.accept(LAYOUT, timeout_s=0.3, ticket=ticket_for("nobody"))
    assert time.monotonic() - start < 3.0
    server.close()


# --- real pairs: gloo between spawned processes --------------------------------------------------

def _sender_main(address, name, commands, replies) -> None:
    """A child process's sender: joins `address`, then follows commands from the test."""
    torch.set_num_threads(1)
    tx = connect(address, LAYOUT, CONFIG, name, ticket=ticket_for(name))
    replies.put({"listening": sorted(listening_addresses())})
    while True:
        cmd, *args = commands.get(timeout=60)
        if cmd == "close":
            tx.close()
            replies.put({"closed": True})
        elif cmd == "rejoin":
            tx = connect(address, LAYOUT, CONFIG, args[0], ticket=ticket_for(args[0]))
            replies.put({"rejoined": True})
        elif cmd == "exit":
            return
        else:
            request_id, seed, num_tokens, corrupt = args
            tx.corrupt_next_payload = corrupt
            try:
                tx.send(request_id, make_kv(seed, num_tokens), num_tokens)
                outcome = "ok"
            except TransferRefused as e:
                outcome = f"refused:{e.reason.name}"
            except KVTransferError as e:
                outcome = f"error:{type(e).__name__}"
            replies.put({"outcome": outcome, "payloads": tx.stats.payloads})


class RemoteSender:
    """A sender in a spawned process; `send` returns at once, `reply` waits for its outcome."""

    def __init__(self, address: tuple[str, int], name: str):
        ctx = mp.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_sender_main, args=(address, name, self.commands, self.replies),
                                   daemon=True)
        self.process.start()

    def send(self, request_id: str, seed: int, num_tokens: int, corrupt: bool = False) -> None:
        self.commands.put(("send", request_id, seed, num_tokens, corrupt))

    def command(self, *cmd) -> None:
        self.commands.put(cmd)

    def reply(self) -> dict:
        return self.replies.get(timeout=30)

    def stop(self) -> None:
        self.commands.put(("exit",))
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


@pytest.fixture(scope="module")
def pair():
    """(receiver channel, remote sender, the child's listening sockets, this process's new ones)."""
    before = listening_addresses()
    server = TransferServer(CONFIG)
    remote = RemoteSender(server.address, "prefill-0")
    rx = server.accept(LAYOUT, ticket=ticket_for("prefill-0"))
    child_listening = {tuple(a) for a in remote.reply()["listening"]}
    ours = listening_addresses() - before
    yield rx, remote, child_listening, ours, server.port
    rx.close()
    server.close()
    remote.stop()


@pytest.mark.timeout(60)
def test_nothing_the_transfer_opens_listens_on_a_wildcard_address(pair):
    _, _, child_listening, ours, store_port = pair
    assert ("127.0.0.1", store_port) in ours  # the rendezvous store, on the configured host
    assert len(child_listening) >= 1  # the sender's gloo pair socket
    for ip, _ in ours | child_listening | listening_addresses():
        assert ip not in WILDCARDS and ip == "127.0.0.1"


@pytest.mark.timeout(60)
def test_kv_arrives_bit_exact_three_requests_in_a_row(pair):
    rx, remote, _, _, _ = pair
    for i, num_tokens in enumerate((10, 4, 37)):
        remote.send(f"req-{i}", 100 + i, num_tokens)
        header, kv = rx.receive()
        assert remote.reply()["outcome"] == "ok"
        assert (header.request_id, header.model_id, header.num_tokens) == (f"req-{i}", "tiny", num_tokens)
        assert (header.num_layers, header.num_kv_heads, header.head_dim, header.block_size) == (2, 2, 16, 4)
        assert header.num_blocks == math.ceil(num_tokens / 4) and header.dtype == torch.float32
        assert (header.tp_size, header.tp_rank, header.head_start, header.head_count) == (1, 0, 0, 2)
        assert header.checksum_algo == ChecksumAlgo.XXH3_64 and header.payload_nbytes == kv.numel() * 4
        assert torch.equal(kv, make_kv(100 + i, num_tokens))


@pytest.mark.timeout(60)
def test_layout_mismatch_is_refused_before_the_payload_and_the_pair_stays_usable(pair):
    rx, remote, _, _, _ = pair
    remote.send("probe", 1, 5)
    rx.receive()
    payloads = remote.reply()["payloads"]

    rx.layout = replace(LAYOUT, head_dim=32)
    remote.send("mismatch", 2, 5)
    try:
        with pytest.raises(LayoutMismatch, match="SHAPE") as mismatch:
            rx.recv_header()
    finally:
        rx.layout = LAYOUT
    assert mismatch.value.reason is RefuseReason.SHAPE
    assert remote.reply() == {"outcome": "refused:SHAPE", "payloads": payloads}  # no payload sent

    remote.send("after-mismatch", 3, 9)
    header, kv = rx.receive()
    assert remote.reply()["outcome"] == "ok" and header.request_id == "after-mismatch"
    assert torch.equal(kv, make_kv(3, 9))


@pytest.mark.timeout(60)
def test_corrupted_payload_raises_checksum_mismatch_on_the_receiver(pair):
    rx, remote, _, _, _ = pair
    remote.send("corrupt", 7, 12, corrupt=True)
    with pytest.raises(ChecksumMismatch, match="'corrupt'"):
        rx.receive()
    assert remote.reply()["outcome"] == "ok"  # the sender cannot tell; the receiver rejects
    remote.send("after-corrupt", 8, 12)
    assert torch.equal(rx.receive()[1], make_kv(8, 12))
    assert remote.reply()["outcome"] == "ok"


@pytest.mark.timeout(60)
def test_receiver_waiting_on_a_silent_sender_times_out(pair):
    """Last test on this pair: a timeout closes the channel."""
    rx, _, _, _, _ = pair
    start = time.monotonic()
    with pytest.raises(TransferTimeout, match="recv header did not complete within 1s"):
        rx.recv_header(timeout_s=1.0)
    assert 0.9 < time.monotonic() - start < 5.0
    with pytest.raises(ChannelClosed):
        rx.recv_header()


@pytest.mark.timeout(90)
def test_pairs_are_independent_one_leaving_does_not_break_the_other():
    server = TransferServer(CONFIG)
    senders = {name: RemoteSender(server.address, name) for name in ("prefill-a", "prefill-b")}
    try:
        channels = {}
        for name in senders:
            rx = server.accept(LAYOUT, ticket=ticket_for(name))
            channels[rx.peer] = rx
        for s in senders.values():
            s.reply()
        a, b = senders["prefill-a"], senders["prefill-b"]
        rx_a, rx_b = channels["prefill-a"], channels["prefill-b"]

        a.send("a-1", 11, 6)
        b.send("b-1", 12, 6)
        assert torch.equal(rx_b.receive()[1], make_kv(12, 6))  # in either order
        assert torch.equal(rx_a.receive()[1], make_kv(11, 6))
        assert a.reply()["outcome"] == b.reply()["outcome"] == "ok"

        a.command("close")
        assert a.reply() == {"closed": True}
        with pytest.raises(ChannelClosed, match="peer closed"):  # at once, not after the timeout
            rx_a.recv_header(timeout_s=10.0)
        b.send("b-2", 13, 6)
        assert torch.equal(rx_b.receive()[1], make_kv(13, 6))
        assert b.reply()["outcome"] == "ok"

        a.command("rejoin", "prefill-a2")  # the same worker joins again: a fresh pair
        rx_a2 = server.accept(LAYOUT, ticket=ticket_for("prefill-a2"))
        assert a.reply() == {"rejoined": True} and rx_a2.peer == "prefill-a2"
        a.send("a2-1", 14, 6)
        b.send("b-3", 15, 6)
        assert torch.equal(rx_a2.receive()[1], make_kv(14, 6))
        assert torch.equal(rx_b.receive()[1], make_kv(15, 6))
        assert a.reply()["outcome"] == b.reply()["outcome"] == "ok"

        server.close()  # stops listening; established pairs keep working
        assert ("127.0.0.1", server.port) not in listening_addresses()
        b.send("b-4", 16, 6)
        assert torch.equal(rx_b.receive()[1], make_kv(16, 6))
        assert b.reply()["outcome"] == "ok"
    finally:
        server.close()
        for s in senders.values():
            s.stop()


# --- GPU -----------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_device_checksum_on_cuda_matches_the_cpu_definition():
    t = torch.randn(3 * (1 << 20) + 1)  # more than one reduction chunk, odd size
    assert payload_checksum(t.cuda()) == payload_checksum(t, ChecksumAlgo.WSUM32)
    with pytest.raises(ValueError, match="host"):
        payload_checksum(t.cuda(), ChecksumAlgo.XXH3_64)


def _nccl_sender_main(address, replies) -> None:
    torch.cuda.set_device(1)
    tx = connect(address, LAYOUT, CONFIG.model_copy(update={"backend": "nccl"}), "prefill-gpu",
                 ticket=ticket_for("prefill-gpu"))
    tx.send("gpu-1", make_kv(21, 10).cuda(), 10)
    replies.put(tx.stats.payloads)
    tx.close()


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_nccl_pair_moves_cuda_kv_exactly():
    if torch.cuda.device_count() < 2:
        pytest.skip("an NCCL pair needs two GPUs (NCCL refuses two ranks on one device)")
    torch.cuda.set_device(0)
    server = TransferServer(CONFIG.model_copy(update={"backend": "nccl"}))
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=_nccl_sender_main, args=(server.address, replies), daemon=True)
    child.start()
    try:
        rx = server.accept(LAYOUT, ticket=ticket_for("prefill-gpu"))
        header, kv = rx.receive()
        assert kv.is_cuda and header.checksum_algo == ChecksumAlgo.WSUM32
        assert torch.equal(kv.cpu(), make_kv(21, 10)) and replies.get(timeout=30) == 1
        rx.close()
    finally:
        server.close()
        child.join(30)
