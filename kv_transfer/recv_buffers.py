"""Reused receive buffers of a decode worker, one per channel, each at most a fixed size.

A payload is received into its channel's buffer (grown to fit, up to the cap) so a steady
stream of requests allocates nothing; a payload above the cap gets a tensor of its own, freed
once the caller has written it into the KV blocks. Without the cap the buffers would only
grow: one long prompt would pin its whole KV in device memory, per channel, for good.
"""
from __future__ import annotations

import torch

from kv_transfer.channel import payload_view
from kv_transfer.header import TransferHeader


class ReceiveBuffers:
    """Owned by one receiver; `view` and `drop` for a channel are called by the thread that
    holds that channel's lock (so a buffer is never handed out twice at once)."""

    def __init__(self, cap_bytes: int):
        self.cap_bytes = cap_bytes
        self._buffers: dict[str, torch.Tensor] = {}  # channel peer -> flat uint8 buffer

    def view(self, peer: str, header: TransferHeader, device: torch.device) -> torch.Tensor:
        """A contiguous header.payload_shape tensor on `device` to receive this payload into."""
        need = header.payload_nbytes
        if need > self.cap_bytes:
            return torch.empty(header.payload_shape, dtype=header.dtype, device=device)
        buf = self._buffers.get(peer)
        if buf is None or buf.numel() < need or buf.device != device:
            self._buffers.pop(peer, None)  # release the old one before allocating its successor
            buf = self._buffers[peer] = torch.empty(need, dtype=torch.uint8, device=device)
        return payload_view(buf, header)

    def drop(self, peer: str) -> None:
        self._buffers.pop(peer, None)

    @property
    def held_bytes(self) -> int:
        return sum(b.numel() for b in self._buffers.values())
