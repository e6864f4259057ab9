"""KV transfer between different tensor-parallel sizes (prefill TP=a, decode TP=b).

A rank of a TP group holds only its KV heads (the rule of engine.parallel.sharding, repeated
here so kv_transfer needs no engine import; tests/integration/test_reshard.py checks the two agree):
with Hkv >= tp, rank r holds heads [r*Hkv/tp, (r+1)*Hkv/tp); with Hkv < tp each head is
replicated and rank r holds head r*Hkv//tp.

The plan sends each decode rank exactly its heads, as whole blocks of one contiguous head
range per message: a decode rank whose heads all live on one prefill rank (a <= b) gets one
message; one whose heads span several prefill ranks (a > b) gets one from each of them
(a/b), which is the fewest possible since no prefill rank holds the others' heads. A head
held by several prefill ranks (replicated) is taken from the rank aligned with the
receiver (same TP: rank to rank), else the first holder. Each message is a
normal transfer (header, ack, payload) whose header names the sender's TP size and rank and
the piece's head range; the receiver accepts it only if it is a piece the plan assigns to
that receiver from that sender (layout.check_header), so a mis-wired pair is refused before
any payload moves.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kv_transfer.channel import SenderChannel
from kv_transfer.config import TransferConfig
from kv_transfer.header import TransferHeader
from kv_transfer.layout import HeadShard, KVLayout
from kv_transfer.rendezvous import connect


def shard_of(num_kv_heads: int, tp_size: int, rank: int) -> HeadShard:
    """The KV heads rank `rank` of a tp_size group holds."""
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} and {num_kv_heads} KV heads must divide one another")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} outside tp_size {tp_size}")
    if num_kv_heads >= tp_size:
        count = num_kv_heads // tp_size
        return HeadShard(tp_size, rank, rank * count, count)
    return HeadShard(tp_size, rank, rank * num_kv_heads // tp_size, 1)


@dataclass(frozen=True)
class Piece:
    """One message: KV heads [head_start, head_start + head_count) from src_rank to dst_rank."""

    src_rank: int
    dst_rank: int
    head_start: int
    head_count: int

    def sender_shard(self, src_tp: int) -> HeadShard:
        """What the sender puts in the header for this piece."""
        return HeadShard(src_tp, self.src_rank, self.head_start, self.head_count)


def plan(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[Piece]:
    """Every message of one request's transfer, in (dst_rank, head) order."""
    sources = [shard_of(num_kv_heads, src_tp, r) for r in range(src_tp)]
    pieces: list[Piece] = []
    for dst in range(dst_tp):
        want = shard_of(num_kv_heads, dst_tp, dst)
        for head in range(want.head_start, want.head_start + want.head_count):
            holders = [s.tp_rank for s in sources if s.head_start <= head < s.head_start + s.head_count]
            aligned = dst * src_tp // dst_tp  # spreads replicated heads: same TP sends rank to rank
            src = aligned if aligned in holders else holders[0]
            last = pieces[-1] if pieces else None
            if last and (last.dst_rank, last.src_rank) == (dst, src) and last.head_start + last.head_count == head:
                pieces[-1] = Piece(src, dst, last.head_start, last.head_count + 1)
            else:
                pieces.append(Piece(src, dst, head, 1))
    return pieces


def pieces_from(num_kv_heads: int, src_tp: int, src_rank: int, dst_tp: int) -> list[Piece]:
    """What one sending rank sends (one piece per decode rank it feeds)."""
    return [p for p in plan(num_kv_heads, src_tp, dst_tp) if p.src_rank == src_rank]


def pieces_to(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[Piece]:
    """What one receiving rank receives."""
    return [p for p in plan(num_kv_heads, src_tp, dst_tp) if p.dst_rank == dst_rank]


def is_planned(num_kv_heads: int, sender: HeadShard, receiver: HeadShard) -> bool:
    """Whether `sender` (the header's TP size, rank and head range) is a piece the plan sends to
    `receiver` (the receiving rank's own shard)."""
    try:
        expected = pieces_to(num_kv_heads, sender.tp_size, receiver.tp_size, receiver.tp_rank)
    except ValueError:
        return False
    piece = Piece(sender.tp_rank, receiver.tp_rank, sender.head_start, sender.head_count)
    return piece in expected


def header_shard(h: TransferHeader) -> HeadShard:
    """The sender's TP position and the piece's heads, as a header states them."""
    return HeadShard(h.tp_size, h.tp_rank, h.head_start, h.head_count)


def cut(kv: torch.Tensor, held: HeadShard, piece: Piece) -> torch.Tensor:
    """The piece's heads out of a sender's KV (2, L, nb, bs, held.head_count, hd): a view."""
    start = piece.head_start - held.head_start
    if start < 0 or start + piece.head_count > held.head_count:
        raise ValueError(f"piece heads [{piece.head_start}, {piece.head_start + piece.head_count}) are not "
                         f"all held by this sender ([{held.head_start}, {held.head_start + held.head_count}))")
    return kv[..., start : start + piece.head_count, :]


def place(out: torch.Tensor, held: HeadShard, piece_shard: HeadShard, payload: torch.Tensor) -> None:
    """Copy a received piece (its header's head range) into the receiver's KV
    (2, L, nb, bs, held.head_count, hd)."""
    start = piece_shard.head_start - held.head_start
    out[..., start : start + piece_shard.head_count, :].copy_(payload)


class ShardedSender:
    """A full-head sender feeding a decode group of TP size b over one pair per decode rank:
    each request goes out as b messages, rank r's carrying exactly rank r's heads. Sent in
    rank order; a refusal or error on one stops the rest (so no later rank is left holding a
    piece its rank 0 never asked it to write). Looks like a SenderChannel to its caller."""

    def __init__(self, channels: list[tuple[Piece, SenderChannel]], num_kv_heads: int, peer: str = ""):
        self.channels, self.peer = channels, peer
        self.full = HeadShard.full(num_kv_heads)
        self.closed = False

    @property
    def corrupt_next_payload(self) -> bool:
        return self.channels[0][1].corrupt_next_payload

    @corrupt_next_payload.setter
    def corrupt_next_payload(self, value: bool) -> None:  # test hook: corrupts rank 0's piece
        self.channels[0][1].corrupt_next_payload = value

    @property
    def broken(self) -> bool:
        return self.closed or any(channel.broken for _, channel in self.channels)

    def send(self, request_id: str, kv: torch.Tensor, num_tokens: int, timeout_s: float | None = None,
             draft_kv: torch.Tensor | None = None) -> None:
        # draft_kv is dropped: a tensor-parallel decode group does not speculate (engine.config).
        for piece, channel in self.channels:
            channel.send(request_id, cut(kv, self.full, piece), num_tokens, timeout_s)

    def close(self) -> None:
        self.closed = True
        for _, channel in self.channels:
            channel.close()


def connect_group(addresses: list[tuple[str, int]], layout: KVLayout, config: TransferConfig,
                  name: str, ticket: str) -> ShardedSender:
    """Join every rank of a decode group (rank order) as a full-head sender (TP=1 side of the
    plan), under the one ticket of the pairing: each rank has its own store."""
    channels = []
    try:
        for piece in plan(layout.num_kv_heads, 1, len(addresses)):
            shard = piece.sender_shard(1)
            channels.append((piece, connect(tuple(addresses[piece.dst_rank]), layout, config, name, shard,
                                           ticket=ticket)))
    except BaseException:
        for _, channel in channels:
            channel.close()
        raise
    return ShardedSender(channels, layout.num_kv_heads, name)
