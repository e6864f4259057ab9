"""Chained block hashes: the names of full KV blocks, shared by the engine and the router.

    h_0 = ROOT (32 zero bytes)
    h_i = SHA-256( b"brigade-kv-v1" || u32le(len(model_id)) || model_id (UTF-8)
                   || h_{i-1} || u32le(n) || u32le(t_1) ... u32le(t_n) )

where t_1..t_n are the block's token ids. A hash therefore names the whole prefix up to
and including its block, for one model. A request with a cache salt (a tenant's) starts its
chain from `salted_root(salt)` = SHA-256(b"brigade-salt-v1" || salt (UTF-8)) instead of
ROOT, so no block of it is ever shared with another salt or with unsalted requests.
Strings are encoded with "surrogatepass": valid text gives its UTF-8 bytes, and a lone surrogate
(which strict UTF-8 refuses) its own three bytes, which no valid text encodes to, so hashing is
total over every Python str and distinct strings still name distinct chains.
Test vectors are in docs/ARCHITECTURE.md and tests/unit/test_block_hash.py.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT = bytes(32)
_DOMAIN = b"brigade-kv-v1"
_SALT_DOMAIN = b"brigade-salt-v1"


def salted_root(salt: str | None) -> bytes:
    """The parent of a request's first block: ROOT, or a per-salt root when it has a salt."""
    return ROOT if not salt else hashlib.sha256(_SALT_DOMAIN + _utf8(salt)).digest()


def block_hash(parent: bytes, tokens: Sequence[int], model_id: str) -> bytes:
    mid = _utf8(model_id)
    h = hashlib.sha256(_DOMAIN)
    h.update(struct.pack("<I", len(mid)))
    h.update(mid)
    h.update(parent)
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    return h.digest()


def chain_hashes(tokens: Sequence[int], block_size: int, model_id: str, parent: bytes = ROOT) -> list[bytes]:
    """Hashes of every full block of `tokens` (a trailing partial block is not named)."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start : start + block_size], model_id)
        out.append(parent)
    return out


def _utf8(text: str) -> bytes:
    """UTF-8 that never raises: a step must not fail on a string a client chose."""
    return text.encode("utf-8", "surrogatepass")
