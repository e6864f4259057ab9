"""Moving KV blocks between a prefill worker and a decode worker.

Entry points: `TransferServer` (receiver side, hosts the pair rendezvous) and `connect`
(sender side) build a pair over torch.distributed, both under the one ticket (`new_ticket`)
the router hands them for that pairing; `inprocess_pair` builds one over queues
for unit tests. Both yield a `SenderChannel` / `ReceiverChannel` (the `KVSender` /
`KVReceiver` protocols of `base`). See base.py for the message flow and ownership rules.
Above the channels, one `Handoff` per request (handoff.py) is owned by the decode-side and the
prefill-side connectors (decode_side.py, prefill_side.py), which the workers delegate to.
"""
from kv_transfer.base import ChannelStats, KVReceiver, KVSender, Link, Msg
from kv_transfer.channel import ReceiverChannel, SenderChannel, payload_view
from kv_transfer.checksum import ChecksumAlgo, payload_checksum
from kv_transfer.config import TransferConfig
from kv_transfer.errors import (
    ChannelClosed,
    ChecksumMismatch,
    HeaderError,
    KVTransferError,
    LayoutMismatch,
    RefuseReason,
    TransferRefused,
    TransferTimeout,
)
from kv_transfer.header import (
    HEADER_SIZE,
    MAX_ID_BYTES,
    DraftSection,
    TransferHeader,
    decode_header,
    draft_model_key,
    encode_header,
)
from kv_transfer.inprocess import inprocess_pair
from kv_transfer.layout import HeadShard, KVLayout, check_draft
from kv_transfer.pg_link import raw_recv, raw_send
from kv_transfer.recv_buffers import ReceiveBuffers
from kv_transfer.rendezvous import TransferServer, connect, new_ticket

__all__ = [
    "HEADER_SIZE", "MAX_ID_BYTES", "ChannelClosed", "ChannelStats", "ChecksumAlgo", "ChecksumMismatch",
    "DraftSection", "HeadShard", "HeaderError", "KVLayout", "KVReceiver", "KVSender", "KVTransferError",
    "LayoutMismatch", "Link", "Msg", "ReceiveBuffers", "ReceiverChannel", "RefuseReason", "SenderChannel",
    "TransferConfig", "TransferHeader", "TransferRefused", "TransferServer", "TransferTimeout", "check_draft",
    "connect", "decode_header", "draft_model_key", "encode_header", "inprocess_pair", "new_ticket",
    "payload_checksum", "payload_view", "raw_recv", "raw_send",
]
