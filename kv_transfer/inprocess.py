"""An in-process pair over queues, for unit tests of callers (no processes, no sockets).

It runs the same SenderChannel/ReceiverChannel code as the real transport; only the link
differs. The sender blocks waiting for the ack, so drive the two ends from two threads.
"""
from __future__ import annotations

import queue

import torch

from kv_transfer.base import Msg
from kv_transfer.channel import ReceiverChannel, SenderChannel
from kv_transfer.errors import ChannelClosed, TransferTimeout
from kv_transfer.layout import HeadShard, KVLayout

_CLOSED = object()


class QueueLink:
    """base.Link over two queues (one per direction). Sent tensors are copied, as on a wire."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue, timeout_s: float):
        self.inbox, self.outbox, self.timeout_s = inbox, outbox, timeout_s
        self.payload_device = torch.device("cpu")
        self.closed = False

    def send(self, tensor: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None:
        if self.closed:
            raise ChannelClosed("link is closed")
        self.outbox.put((kind, tensor.detach().to("cpu", copy=True)))

    def recv(self, out: torch.Tensor, kind: Msg, timeout_s: float | None = None) -> None:
        if self.closed:
            raise ChannelClosed("link is closed")
        timeout = timeout_s or self.timeout_s
        try:
            item = self.inbox.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise TransferTimeout(f"recv {kind.name.lower()} did not complete within {timeout:g}s; "
                                  "channel closed") from None
        if item is _CLOSED:
            self.close()
            raise ChannelClosed(f"recv {kind.name.lower()}: the peer closed the channel")
        got, tensor = item
        want, size = out.numel() * out.element_size(), tensor.numel() * tensor.element_size()
        if got is not kind or size != want:
            self.close()
            raise ChannelClosed(f"expected {kind.name} of {want} bytes, got {got.name} of {size}; "
                                "channel closed")
        out.view(-1).view(torch.uint8).copy_(tensor.reshape(-1).view(torch.uint8))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.outbox.put(_CLOSED)
            self.inbox.put(_CLOSED)  # and a receive of our own that waits ends too


def inprocess_pair(layout: KVLayout, shard: HeadShard | None = None, receiver_layout: KVLayout | None = None,
                   timeout_s: float = 5.0) -> tuple[SenderChannel, ReceiverChannel]:
    """A connected (sender, receiver) pair; the receiver expects `receiver_layout` (default: the
    sender's layout) and the same shard."""
    to_receiver, to_sender = queue.Queue(), queue.Queue()
    sender = SenderChannel(QueueLink(to_sender, to_receiver, timeout_s), layout, shard, "inprocess-sender")
    receiver = ReceiverChannel(QueueLink(to_receiver, to_sender, timeout_s), receiver_layout or layout, shard,
                               "inprocess-receiver")
    return sender, receiver
