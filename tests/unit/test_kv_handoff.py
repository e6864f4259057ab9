"""The decode-side connector over an in-process pair and a fake of the engine it drives: each
request's Handoff moves reserved -> pulling -> written -> admitted; KV sent before the decode
stream asks for it waits, written, in its blocks; a header for a hand-off that ended (aborted,
stale, never reserved, reserved for another prefill worker) is refused and the pair goes on;
an abort waits for a write in progress; illegal moves raise."""
from __future__ import annotations

import threading

import pytest
import torch
from support import wait_for

from engine.block_pool import NoFreeBlocks
from engine.messages import GenerateRequest, KVHandle
from kv_transfer import KVLayout, KVTransferError, TransferConfig, TransferRefused, inprocess_pair
from kv_transfer.decode_side import DecodeConnector
from kv_transfer.handoff import Handoff, HandoffState

S = HandoffState
LAYOUT = KVLayout(model_id="m", num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=torch.float32)


class FakeEngine:
    """The DecodeEngine protocol over a list of free block ids; records what was written where."""

    runner = None

    def __init__(self, num_blocks: int = 8):
        self.free = list(range(num_blocks))
        self.written: dict[int, torch.Tensor] = {}
        self.gate: threading.Event | None = None  # when set, write_kv waits for it

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        n = -(-num_tokens // LAYOUT.block_size)
        if n > len(self.free):
            raise NoFreeBlocks(f"{n} blocks wanted")
        out, self.free = self.free[:n], self.free[n:]
        return out

    def reserve_draft(self, request_id: str, num_tokens: int) -> None:
        return None

    def write_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        if self.gate is not None:
            self.gate.wait(10)
        for i, b in enumerate(block_ids):
            self.written[b] = kv[:, :, i].clone()

    def write_draft_kv(self, block_ids, kv) -> None:
        raise AssertionError("no draft here")


@pytest.fixture
def pair():
    engine = FakeEngine()
    connector = DecodeConnector("decode-0", engine, TransferConfig(backend="gloo", timeout_s=5.0), LAYOUT, None, None)
    tx, rx = inprocess_pair(LAYOUT, timeout_s=5.0)
    rx.peer = "prefill-0"
    connector.attach(rx)
    yield connector, engine, tx
    connector.close()
    tx.close()


def kv(num_blocks: int, fill: float) -> torch.Tensor:
    return torch.full((2, LAYOUT.num_layers, num_blocks, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim),
                      fill)


def test_kv_sent_before_the_stream_asks_waits_written_in_its_blocks(pair):
    connector, engine, tx = pair
    handle = connector.reserve(engine, "r", 6, "prefill-0")  # 2 blocks
    assert connector.handoffs["r"].state is S.RESERVED
    tx.send("r", kv(2, 1.5), 6)  # returns once the receiving thread took the payload
    wait_for(lambda: connector.handoffs["r"].state is S.WRITTEN, 5, "the KV written")
    h = connector.wait(handle, GenerateRequest("r", [1] * 6))
    assert h.state is S.WRITTEN and h.nbytes == kv(2, 0).numel() * 4
    assert all(torch.all(engine.written[b] == 1.5) for b in h.blocks)
    connector.admitted(h)
    assert h.state is S.ADMITTED and "r" not in connector.handoffs


def test_a_header_no_reservation_waits_for_is_refused_and_the_pair_goes_on(pair):
    connector, engine, tx = pair
    handle = connector.reserve(engine, "mine", 4, "prefill-0")
    other = connector.reserve(engine, "elsewhere", 4, "prefill-9")  # reserved for another prefill worker
    assert connector.abort("mine")  # aborted before its KV came
    for rid in ("mine", "never", "elsewhere"):
        with pytest.raises(TransferRefused):
            tx.send(rid, kv(1, 2.0), 4)
    assert connector.handoffs["elsewhere"].state is S.RESERVED and engine.written == {}
    with pytest.raises(KVTransferError, match="aborted or stale"):
        connector.wait(handle, GenerateRequest("mine", [1] * 4))
    again = connector.reserve(engine, "next", 4, "prefill-0")
    tx.send("next", kv(1, 3.0), 4)  # the same pair, in step
    assert connector.wait(again, GenerateRequest("next", [1] * 4)).state is S.WRITTEN
    assert other is not None


def test_a_pair_that_closes_fails_the_wait_at_once_and_sent_nothing_fails_too(pair):
    connector, engine, tx = pair
    handle = connector.reserve(engine, "r", 4, "prefill-0")
    unsent = connector.reserve(engine, "u", 4, "prefill-0")
    with pytest.raises(KVTransferError, match="sent no KV"):
        connector.wait(unsent, GenerateRequest("u", [1] * 4), kv_sent=False)
    assert connector.handoffs["u"].state is S.FAILED
    tx.close()  # the prefill worker left
    with pytest.raises(KVTransferError, match="no working pair"):
        connector.wait(handle, GenerateRequest("r", [1] * 4))
    assert connector.abort("r") and connector.abort("u") and connector.handoffs == {}


def test_abort_waits_for_a_write_in_progress_and_stale_sweeps_skip_it(pair):
    connector, engine, tx = pair
    connector.reserve(engine, "r", 4, "prefill-0")
    engine.gate = threading.Event()
    threading.Thread(target=tx.send, args=("r", kv(1, 4.0), 4), daemon=True).start()
    wait_for(lambda: connector.handoffs["r"].state is S.PULLING, 5, "the write started")
    connector.handoffs["r"].reserved_at -= 10_000
    assert connector.take_stale() == []  # a hand-off being written is never stale
    aborted = threading.Thread(target=connector.abort, args=("r",))
    aborted.start()
    aborted.join(0.3)
    assert aborted.is_alive()  # waiting for the write: its blocks are not free yet
    engine.gate.set()
    aborted.join(5)
    assert not aborted.is_alive() and "r" not in connector.handoffs


def test_a_written_hand_off_nobody_admits_goes_stale():
    engine = FakeEngine()
    connector = DecodeConnector("d", engine, TransferConfig(backend="gloo", hold_timeout_s=1.0), LAYOUT, None, None)
    try:
        handle = connector.reserve(engine, "r", 4, "p")
        connector.handoffs["r"].reserved_at -= 10
        assert connector.take_stale() == ["r"] and connector.handoffs == {}
        assert connector.reserve(engine, "big", 100, "p") is None  # the pool is full: no handle
        assert handle.decode_id == "d"
    finally:
        connector.close()


def test_illegal_moves_raise():
    h = Handoff(KVHandle("r", "p", "d", 4), blocks=[0])
    with pytest.raises(RuntimeError, match="no move from reserved to admitted"):
        h.move(S.ADMITTED)
    h.move(S.PULLING)
    with pytest.raises(RuntimeError, match="no move from pulling to aborted"):
        h.move(S.ABORTED)  # abort() waits for the write instead
