"""What can go wrong moving KV, as exceptions the caller can act on.

Every failure is a `KVTransferError`. The caller's move is always the same: free what it
reserved for the request and recompute or retry it; bad bytes are never decoded.
"""
from __future__ import annotations

from enum import IntEnum


class RefuseReason(IntEnum):
    """Why a receiver declined a request; travels in the ack, so values are wire codes."""

    BAD_HEADER = 1  # the header did not decode (magic, version, crc, inconsistent fields)
    MODEL = 2  # another model id
    SHAPE = 3  # layers, KV heads, head_dim or block size differ
    DTYPE = 4
    HEAD_RANGE = 5  # the payload covers other KV heads than this receiver holds
    CHECKSUM_ALGO = 6  # the receiver cannot compute this checksum where its buffer lives
    NO_CAPACITY = 7  # the receiver's caller had no free blocks
    CALLER = 8  # the receiver's caller declined for its own reason


class KVTransferError(Exception):
    """Base of every kv_transfer failure."""


class HeaderError(KVTransferError, ValueError):
    """A header that cannot be encoded or decoded (bad magic/version/crc, truncated, ids too long)."""


class LayoutMismatch(KVTransferError):
    """The payload's layout is not the one expected. Raised on the receiver, before any payload
    byte is read (the sender got a refusal), or on the sender for a tensor that does not match
    its own layout. `request_id`: the refused header's, when it decoded."""

    def __init__(self, reason: RefuseReason, message: str, request_id: str | None = None):
        super().__init__(f"{reason.name}: {message}")
        self.reason = reason
        self.request_id = request_id


class ChecksumMismatch(KVTransferError):
    """The payload arrived but its checksum differs from the header's: the bytes are bad."""


class TransferRefused(KVTransferError):
    """The receiver declined the request (sender side); no payload was sent."""

    def __init__(self, request_id: str, reason: RefuseReason):
        super().__init__(f"receiver refused request {request_id!r}: {reason.name}")
        self.request_id = request_id
        self.reason = reason


class ChannelClosed(KVTransferError):
    """The channel is closed: closed here, the peer left or crashed, or an earlier timeout or
    protocol error broke it. Reconnect to continue."""


class TransferTimeout(ChannelClosed):
    """A blocking step did not finish in time. The channel is closed afterwards (gloo closes a
    pair whose operation timed out), so this is also a `ChannelClosed`."""
