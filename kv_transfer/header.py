"""The wire header that precedes every KV payload: explicit little-endian bytes, never pickle.

Fixed size (HEADER_SIZE bytes, zero padded), so a receiver can post one fixed-size uint8
receive before it knows anything about the request. Layout, in order (struct format `<`):

    magic 8s | version H | header_size H
    request_id: length H + 128s | model_id: length H + 128s       (UTF-8, zero padded)
    num_layers I | num_kv_heads I (the model's total) | head_dim I | block_size I | dtype H
    num_tokens Q | num_blocks I
    tp_size H | tp_rank H | head_start I | head_count I           (the sender's shard)
    payload_nbytes Q | checksum_algo H | checksum Q
    version 2 only, the draft section (speculative decoding):
    draft_model_key Q | draft_num_layers I | draft_num_kv_heads I | draft_head_dim I | draft_dtype H
    draft_num_tokens Q | draft_num_blocks I | draft_payload_nbytes Q | draft_checksum Q
    zero padding up to HEADER_SIZE - 4 | crc32 of everything before it I

The payload is one contiguous tensor (2, num_layers, num_blocks, block_size, head_count,
head_dim) of `dtype`, covering KV heads [head_start, head_start + head_count). With a draft
section a second payload may follow it: the draft model's KV of the first draft_num_tokens
tokens, (2, draft_num_layers, draft_num_blocks, block_size, draft_num_kv_heads, draft_head_dim)
of draft_dtype (all heads, same block size), checksummed with the same algorithm.

Version 1 is a header without a draft section and is still what a sender writes then, so a
decode worker from before draft KV keeps taking target-only KV; version 2 adds the section.
"""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass

import torch
import xxhash

from kv_transfer.checksum import ChecksumAlgo
from kv_transfer.errors import HeaderError

MAGIC = b"BRGDKVH\x00"
VERSION = 2  # the newest this side speaks; it reads every version in VERSIONS
VERSIONS = (1, 2)
HEADER_SIZE = 512
MAX_ID_BYTES = 128

_FIELDS = struct.Struct("<8sHH" "H128s" "H128s" "IIIIH" "QI" "HHII" "QHQ")
_DRAFT = struct.Struct("<QIIIH" "QIQQ")
_CRC = struct.Struct("<I")
_CRC_AT = HEADER_SIZE - _CRC.size
assert _FIELDS.size + _DRAFT.size <= _CRC_AT

# Wire codes; never renumber one, only add.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float8_e4m3fn: 4,
    torch.float8_e5m2: 5,
}
_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def draft_model_key(model_id: str) -> int:
    """64 bits naming a draft model in the header (its full id would not fit beside the target's)."""
    return xxhash.xxh3_64_intdigest(model_id.encode("utf-8"))


@dataclass(frozen=True)
class DraftSection:
    """The draft model's KV riding with the target's (speculative decoding, version 2 headers):
    what the receiver checks against its own draft model before it takes the second payload."""

    model_key: int  # draft_model_key(the draft's model id)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    num_tokens: int
    num_blocks: int
    payload_nbytes: int
    checksum: int  # by the header's checksum_algo

    def payload_shape(self, block_size: int) -> tuple[int, int, int, int, int, int]:
        """(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)"""
        return (2, self.num_layers, self.num_blocks, block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class TransferHeader:
    """Everything a receiver checks before it accepts a payload. Construction validates that
    the fields are self-consistent (HeaderError otherwise); whether they match the receiver's
    own layout is `layout.check_header`'s job."""

    request_id: str
    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_tokens: int
    num_blocks: int
    tp_size: int
    tp_rank: int
    head_start: int
    head_count: int
    payload_nbytes: int
    checksum_algo: int
    checksum: int
    draft: DraftSection | None = None

    def __post_init__(self) -> None:
        for name, value in (("request_id", self.request_id), ("model_id", self.model_id)):
            size = len(value.encode("utf-8"))
            if not 0 < size <= MAX_ID_BYTES:
                raise HeaderError(f"{name} must be 1..{MAX_ID_BYTES} UTF-8 bytes, got {size}")
        if self.dtype not in DTYPE_CODES:
            raise HeaderError(f"dtype {self.dtype} has no wire code")
        if self.checksum_algo not in ChecksumAlgo.__members__.values():
            raise HeaderError(f"unknown checksum algorithm {self.checksum_algo}")
        if min(self.num_layers, self.num_kv_heads, self.head_dim, self.block_size, self.num_tokens,
               self.tp_size, self.head_count) < 1:
            raise HeaderError("layers, heads, head_dim, block_size, tokens, tp_size and head_count "
                              "must be >= 1")
        if self.num_blocks != math.ceil(self.num_tokens / self.block_size):
            raise HeaderError(f"{self.num_tokens} tokens need {math.ceil(self.num_tokens / self.block_size)} "
                              f"blocks of {self.block_size}, header says {self.num_blocks}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise HeaderError(f"tp_rank {self.tp_rank} outside tp_size {self.tp_size}")
        if not 0 <= self.head_start <= self.num_kv_heads - self.head_count:
            raise HeaderError(f"head range [{self.head_start}, {self.head_start + self.head_count}) "
                              f"outside {self.num_kv_heads} KV heads")
        if self.payload_nbytes != math.prod(self.payload_shape) * self.dtype.itemsize:
            raise HeaderError(f"payload_nbytes {self.payload_nbytes} does not match shape "
                              f"{self.payload_shape} of {self.dtype}")
        if not 0 <= self.checksum < 1 << 64:
            raise HeaderError("checksum must fit in 64 unsigned bits")
        if self.draft is not None:
            self._check_draft(self.draft)

    def _check_draft(self, d: DraftSection) -> None:
        if d.dtype not in DTYPE_CODES:
            raise HeaderError(f"draft dtype {d.dtype} has no wire code")
        if min(d.num_layers, d.num_kv_heads, d.head_dim) < 1:
            raise HeaderError("draft layers, heads and head_dim must be >= 1")
        if not 1 <= d.num_tokens <= self.num_tokens:
            raise HeaderError(f"draft covers {d.num_tokens} tokens; 1..{self.num_tokens} (the target's) allowed")
        if d.num_blocks != math.ceil(d.num_tokens / self.block_size):
            raise HeaderError(f"{d.num_tokens} draft tokens need {math.ceil(d.num_tokens / self.block_size)} "
                              f"blocks of {self.block_size}, header says {d.num_blocks}")
        if d.payload_nbytes != math.prod(d.payload_shape(self.block_size)) * d.dtype.itemsize:
            raise HeaderError(f"draft_payload_nbytes {d.payload_nbytes} does not match shape "
                              f"{d.payload_shape(self.block_size)} of {d.dtype}")
        if not (0 <= d.model_key < 1 << 64 and 0 <= d.checksum < 1 << 64):
            raise HeaderError("draft model key and checksum must fit in 64 unsigned bits")

    @property
    def payload_shape(self) -> tuple[int, int, int, int, int, int]:
        """(2, num_layers, num_blocks, block_size, head_count, head_dim)"""
        return (2, self.num_layers, self.num_blocks, self.block_size, self.head_count, self.head_dim)


def encode_header(h: TransferHeader) -> bytes:
    """HEADER_SIZE bytes for `h` (already validated by its construction): version 1 without a
    draft section, 2 with one."""
    rid, mid = h.request_id.encode("utf-8"), h.model_id.encode("utf-8")
    body = _FIELDS.pack(
        MAGIC, 1 if h.draft is None else 2, HEADER_SIZE, len(rid), rid, len(mid), mid,
        h.num_layers, h.num_kv_heads, h.head_dim, h.block_size, DTYPE_CODES[h.dtype],
        h.num_tokens, h.num_blocks, h.tp_size, h.tp_rank, h.head_start, h.head_count,
        h.payload_nbytes, h.checksum_algo, h.checksum,
    )
    if (d := h.draft) is not None:
        body += _DRAFT.pack(d.model_key, d.num_layers, d.num_kv_heads, d.head_dim, DTYPE_CODES[d.dtype],
                            d.num_tokens, d.num_blocks, d.payload_nbytes, d.checksum)
    body = body.ljust(_CRC_AT, b"\x00")
    return body + _CRC.pack(zlib.crc32(body))


def decode_header(data: bytes | bytearray | memoryview) -> TransferHeader:
    """Parse and validate a header; HeaderError names the first problem found."""
    data = bytes(data)
    if len(data) != HEADER_SIZE:
        raise HeaderError(f"header is {len(data)} bytes, expected {HEADER_SIZE} (truncated or not a header)")
    (magic, version, size, rid_len, rid, mid_len, mid, layers, heads, head_dim, block_size, dtype_code,
     num_tokens, num_blocks, tp_size, tp_rank, head_start, head_count, nbytes, algo, checksum,
     ) = _FIELDS.unpack_from(data)
    if magic != MAGIC:
        raise HeaderError(f"bad magic {magic!r}: not a Brigade KV header")
    if version not in VERSIONS:
        raise HeaderError(f"header version {version} not supported (this side speaks {VERSIONS})")
    if size != HEADER_SIZE:
        raise HeaderError(f"header_size field says {size}, expected {HEADER_SIZE}")
    (crc,) = _CRC.unpack_from(data, _CRC_AT)
    if crc != zlib.crc32(data[:_CRC_AT]):
        raise HeaderError("header crc32 mismatch: the header was corrupted")
    if rid_len > MAX_ID_BYTES or mid_len > MAX_ID_BYTES:
        raise HeaderError(f"id length over {MAX_ID_BYTES} bytes")
    if dtype_code not in _DTYPES:
        raise HeaderError(f"unknown dtype code {dtype_code}")
    try:
        request_id, model_id = rid[:rid_len].decode("utf-8"), mid[:mid_len].decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"id is not UTF-8: {e}") from None
    draft = None
    if version >= 2:
        (key, d_layers, d_heads, d_head_dim, d_dtype, d_tokens, d_blocks, d_nbytes, d_checksum,
         ) = _DRAFT.unpack_from(data, _FIELDS.size)
        if d_dtype not in _DTYPES:
            raise HeaderError(f"unknown draft dtype code {d_dtype}")
        draft = DraftSection(key, d_layers, d_heads, d_head_dim, _DTYPES[d_dtype], d_tokens, d_blocks, d_nbytes,
                             d_checksum)
    return TransferHeader(request_id, model_id, layers, heads, head_dim, block_size, _DTYPES[dtype_code],
                          num_tokens, num_blocks, tp_size, tp_rank, head_start, head_count, nbytes, algo,
                          checksum, draft)
