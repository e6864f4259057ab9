"""The message flow of one request (header, ack, payload) over any Link.

With speculative decoding the header may carry a draft section (kv_transfer.header): the
receiver then answers ACCEPT (both payloads follow, the target's then the draft's, each a
PAYLOAD message) or ACCEPT_TARGET_ONLY (it has no room or no use for the draft's KV: only the
target's follows, and its draft model recomputes the prompt), or refuses as always.

Both transports (torch.distributed pairs and in-process queues) run this same code, so a
caller tested against the in-process pair sees exactly the real protocol.
"""
from __future__ import annotations

import torch

from kv_transfer.base import ChannelStats, Link, Msg
from kv_transfer.checksum import payload_checksum
from kv_transfer.errors import (
    ChannelClosed,
    ChecksumMismatch,
    HeaderError,
    RefuseReason,
    TransferRefused,
)
from kv_transfer.header import HEADER_SIZE, TransferHeader, decode_header, encode_header
from kv_transfer.layout import HeadShard, KVLayout, check_header, make_draft_section, make_header

ACK_MAGIC = int.from_bytes(b"KVACK", "big")  # a wrong value means the two ends lost step
ACCEPT = 0
ACCEPT_TARGET_ONLY = 64  # never a RefuseReason: the header's draft section is declined, the target's KV taken


def _ack_tensor(code: int = 0) -> torch.Tensor:
    return torch.tensor([ACK_MAGIC, code], dtype=torch.int64)  # (2,): magic, ACCEPT or a RefuseReason


def _fits(t: torch.Tensor, shape: tuple, dtype: torch.dtype, device: torch.device) -> bool:
    return tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous() and t.device == device


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # (nbytes,), same storage; t must be contiguous


def payload_view(buffer: torch.Tensor, header: TransferHeader) -> torch.Tensor:
    """The first payload_nbytes of a reusable flat uint8 `buffer`, viewed as the header's
    payload (contiguous, header.payload_shape, header.dtype), to receive into without a
    fresh allocation per request."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < header.payload_nbytes:
        raise ValueError(f"need a 1-D uint8 buffer of at least {header.payload_nbytes} bytes")
    return buffer[: header.payload_nbytes].view(header.dtype).view(header.payload_shape)


def _corrupted(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` with one byte flipped (test hooks; the caller's tensor stays as it was)."""
    t = t.clone()
    flat = _flat_bytes(t)
    flat[flat.numel() // 2] ^= 0xFF
    return t


class SenderChannel:
    """The prefill end of one pair (implements base.KVSender). Owns its link. `draft_layout`:
    the layout of the draft model whose KV this sender may ship with the target's (None: none)."""

    def __init__(self, link: Link, layout: KVLayout, shard: HeadShard | None = None, peer: str = ""):
        self.link, self.layout = link, layout
        self.shard = shard or HeadShard.full(layout.num_kv_heads)
        self.peer = peer
        self.draft_layout: KVLayout | None = None
        self.stats = ChannelStats()
        self.corrupt_next_payload = False
        self.corrupt_next_draft_payload = False
        self.closed = False

    @property
    def broken(self) -> bool:
        """Closed, by its owner or by a failure of the link (a timeout, a reset): only a new
        pair carries KV to this peer again."""
        return self.closed or self.link.closed

    def send(self, request_id: str, kv: torch.Tensor, num_tokens: int,
             timeout_s: float | None = None, draft_kv: torch.Tensor | None = None) -> TransferHeader:
        """As base.KVSender.send; `draft_kv` (2, L', nb, bs, H', hd'), the draft model's KV of the
        same tokens in self.draft_layout, goes too unless the receiver declines it."""
        if self.closed:
            raise ChannelClosed("sender channel is closed")
        # With gloo a CUDA tensor goes through the host; with NCCL it stays on the device.
        kv = kv.to(self.link.payload_device).contiguous()
        algo, value = payload_checksum(kv)
        draft = None
        if draft_kv is not None:
            if self.draft_layout is None:
                raise ValueError("draft_kv given to a sender without a draft_layout")
            draft_kv = draft_kv.to(self.link.payload_device).contiguous()
            draft = make_draft_section(draft_kv, num_tokens, self.draft_layout, payload_checksum(draft_kv, algo)[1])
        header = make_header(request_id, kv, num_tokens, self.layout, self.shard, (algo, value), draft)
        self.stats.requests += 1
        wire = torch.frombuffer(bytearray(encode_header(header)), dtype=torch.uint8)  # (HEADER_SIZE,)
        self.link.send(wire, Msg.HEADER, timeout_s)
        ack = torch.zeros(2, dtype=torch.int64)
        self.link.recv(ack, Msg.ACK, timeout_s)
        magic, code = ack.tolist()
        if magic != ACK_MAGIC:
            self.close()
            raise ChannelClosed(f"bad ack {ack.tolist()} for {request_id!r}: the ends lost step; "
                                "channel closed")
        if code not in (ACCEPT, ACCEPT_TARGET_ONLY) or (code == ACCEPT_TARGET_ONLY and draft is None):
            if code not in RefuseReason.__members__.values():
                self.close()
                raise ChannelClosed(f"unknown ack code {code} for {request_id!r}; channel closed")
            self.stats.refused += 1
            raise TransferRefused(request_id, RefuseReason(code))
        self.stats.accepted += 1
        if self.corrupt_next_payload:  # test hook: the header already carries the good checksum
            self.corrupt_next_payload = False
            kv = _corrupted(kv)
        self.link.send(_flat_bytes(kv), Msg.PAYLOAD, timeout_s)
        self.stats.payloads += 1
        self.stats.payload_bytes += header.payload_nbytes
        if draft_kv is not None and code == ACCEPT:
            if self.corrupt_next_draft_payload:  # test hook, as above
                self.corrupt_next_draft_payload = False
                draft_kv = _corrupted(draft_kv)
            self.link.send(_flat_bytes(draft_kv), Msg.PAYLOAD, timeout_s)
            self.stats.payloads += 1
            self.stats.payload_bytes += header.draft.payload_nbytes
        return header

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.link.close()


class ReceiverChannel:
    """The decode end of one pair (implements base.KVReceiver). Owns its link. `layout` and
    `shard` are what this receiver holds, `draft_layout` its draft model's (None: none); the
    caller may replace them between requests."""

    def __init__(self, link: Link, layout: KVLayout, shard: HeadShard | None = None, peer: str = ""):
        self.link, self.layout = link, layout
        self.shard = shard or HeadShard.full(layout.num_kv_heads)
        self.peer = peer
        self.draft_layout: KVLayout | None = None
        self.stats = ChannelStats()
        self.closed = False
        self._pending: TransferHeader | None = None  # checked, waiting for recv_payload/refuse
        self._header_buf = torch.empty(HEADER_SIZE, dtype=torch.uint8)

    @property
    def broken(self) -> bool:
        """As SenderChannel.broken."""
        return self.closed or self.link.closed

    def recv_header(self, timeout_s: float | None = None) -> TransferHeader:
        self._check_open()
        if self._pending is not None:
            raise RuntimeError(f"request {self._pending.request_id!r} still needs recv_payload() or refuse()")
        self.link.recv(self._header_buf, Msg.HEADER, timeout_s)
        self.stats.requests += 1
        try:
            header = decode_header(self._header_buf.numpy().tobytes())
        except HeaderError:
            self._answer(RefuseReason.BAD_HEADER)
            raise
        mismatch = check_header(header, self.layout, self.shard, self.link.payload_device)
        if mismatch is not None:
            self._answer(mismatch.reason)
            mismatch.request_id = header.request_id  # whose hand-off fails (decode_side)
            raise mismatch
        self._pending = header
        return header

    def refuse(self, header: TransferHeader, reason: RefuseReason = RefuseReason.CALLER) -> None:
        self._take(header)
        self._answer(reason)

    def recv_payload(self, header: TransferHeader, out: torch.Tensor | None = None,
                     timeout_s: float | None = None, draft_out: torch.Tensor | None = None) -> torch.Tensor:
        """As base.KVReceiver.recv_payload. `draft_out` (a contiguous tensor of the header's draft
        payload shape and dtype, see draft_buffer) takes the draft's KV too; without it a draft
        section is declined (ACCEPT_TARGET_ONLY). Both payloads are received before either is
        checked, so a bad one leaves the pair in step; ChecksumMismatch names which was bad."""
        self._check_open()
        if out is None:
            out = torch.empty(header.payload_shape, dtype=header.dtype, device=self.link.payload_device)
        elif not _fits(out, header.payload_shape, header.dtype, self.link.payload_device):
            raise ValueError(f"out must be a contiguous {header.payload_shape} {header.dtype} tensor on "
                             f"{self.link.payload_device}")  # before the ack: the request stays pending
        d = header.draft
        if draft_out is not None and (d is None or not _fits(draft_out, d.payload_shape(header.block_size), d.dtype,
                                                             self.link.payload_device)):
            raise ValueError("draft_out given for a header without a draft section, or not of its shape")
        self._take(header)
        code = ACCEPT if draft_out is not None or header.draft is None else ACCEPT_TARGET_ONLY
        self.link.send(_ack_tensor(code), Msg.ACK, timeout_s)
        self.stats.accepted += 1
        self.link.recv(_flat_bytes(out), Msg.PAYLOAD, timeout_s)
        self.stats.payloads += 1
        self.stats.payload_bytes += header.payload_nbytes
        if draft_out is not None:
            self.link.recv(_flat_bytes(draft_out), Msg.PAYLOAD, timeout_s)
            self.stats.payloads += 1
            self.stats.payload_bytes += header.draft.payload_nbytes
        self._verify(header, out, header.checksum, header.payload_nbytes, "payload")
        if draft_out is not None:
            self._verify(header, draft_out, header.draft.checksum, header.draft.payload_nbytes, "draft payload")
        return out

    def draft_buffer(self, header: TransferHeader) -> torch.Tensor:
        """A fresh tensor to receive the header's draft KV into (small next to the target's, so
        not pooled like the target's receive buffers)."""
        d = header.draft
        return torch.empty(d.payload_shape(header.block_size), dtype=d.dtype, device=self.link.payload_device)

    def _verify(self, header: TransferHeader, t: torch.Tensor, want: int, nbytes: int, what: str) -> None:
        _, value = payload_checksum(t, header.checksum_algo)
        if value != want:
            self.stats.checksum_failures += 1
            raise ChecksumMismatch(f"request {header.request_id!r}: {what} checksum {value:#018x}, header "
                                   f"says {want:#018x}; the {nbytes} bytes are bad")

    def receive(self, out: torch.Tensor | None = None,
                timeout_s: float | None = None) -> tuple[TransferHeader, torch.Tensor]:
        """recv_header then recv_payload, for callers with nothing to decide in between."""
        header = self.recv_header(timeout_s)
        return header, self.recv_payload(header, out, timeout_s)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.link.close()

    def _check_open(self) -> None:
        if self.closed:
            raise ChannelClosed("receiver channel is closed")

    def _take(self, header: TransferHeader) -> None:
        if self._pending is not header:
            raise RuntimeError(f"request {header.request_id!r} is not the pending header of this channel")
        self._pending = None

    def _answer(self, reason: RefuseReason) -> None:
        self.stats.refused += 1
        self.link.send(_ack_tensor(int(reason)), Msg.ACK)
