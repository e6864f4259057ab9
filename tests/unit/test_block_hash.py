"""Block hashes name prefix blocks across processes (engine, router, prefix index): pin them down.

The vectors below were computed once from engine/block_hash.py and are repeated in
docs/ARCHITECTURE.md. A change to the definition must be deliberate: bump the domain tag
(b"brigade-kv-v1") and update both places, since stale indexes would otherwise mismatch.
"""
from __future__ import annotations

import hashlib
import struct

import pytest

from engine.block_hash import ROOT, block_hash, chain_hashes
from engine.sampling import SamplingParams
from engine.sequence import Sequence

TINY_1234 = "739741482406c37aed7161a64eb2919f3d6a069940ca5e09083ad4c85f40b4b0"  # parent ROOT, "tiny"
TINY_5678 = "6fdfe240cfa3544a30618e58c9220d52cf1b14b054a14e2ccfb0e2ea235334fe"  # parent TINY_1234
MOE_1234 = "6351fd88f8c421d4b3f79e94e44cc4afc09bcb591f0556b5440b0275f83678a6"  # parent ROOT, "tiny-moe"


def test_vectors() -> None:
    assert ROOT == bytes(32)
    assert block_hash(ROOT, [1, 2, 3, 4], "tiny").hex() == TINY_1234
    assert block_hash(bytes.fromhex(TINY_1234), [5, 6, 7, 8], "tiny").hex() == TINY_5678
    assert block_hash(ROOT, [1, 2, 3, 4], "tiny-moe").hex() == MOE_1234


def test_vectors_follow_the_documented_byte_layout() -> None:
    """SHA-256(b"brigade-kv-v1" || u32le(len(model_id)) || model_id || parent || u32le(n) || u32le(t_i)...)."""

    def spec(parent: bytes, tokens: list[int], model_id: str) -> str:
        mid = model_id.encode("utf-8")
        data = b"brigade-kv-v1" + struct.pack("<I", len(mid)) + mid + parent
        data += struct.pack("<I", len(tokens)) + b"".join(struct.pack("<I", t) for t in tokens)
        return hashlib.sha256(data).hexdigest()

    assert spec(ROOT, [1, 2, 3, 4], "tiny") == TINY_1234
    assert spec(bytes.fromhex(TINY_1234), [5, 6, 7, 8], "tiny") == TINY_5678
    assert spec(ROOT, [1, 2, 3, 4], "tiny-moe") == MOE_1234
    # Non-ASCII model ids are UTF-8 and length-prefixed in bytes.
    assert block_hash(ROOT, [70000], "modèle").hex() == spec(ROOT, [70000], "modèle")


def test_chaining_names_the_whole_prefix() -> None:
    assert [h.hex() for h in chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "tiny")] == [TINY_1234, TINY_5678]
    # The same block after a different prefix gets a different name.
    other = chain_hashes([1, 2, 3, 9, 5, 6, 7, 8], 4, "tiny")
    assert other[1] != bytes.fromhex(TINY_5678)
    assert block_hash(ROOT, [5, 6, 7, 8], "tiny").hex() != TINY_5678
    # Starting from a given parent continues the chain.
    assert chain_hashes([5, 6, 7, 8], 4, "tiny", parent=bytes.fromhex(TINY_1234))[0].hex() == TINY_5678
    # Token order, block boundaries and the model id all matter.
    assert block_hash(ROOT, [2, 1, 3, 4], "tiny").hex() != TINY_1234
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 8, "tiny")[0].hex() not in (TINY_1234, TINY_5678)
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, "tiny-moe")[0].hex() == MOE_1234


@pytest.mark.parametrize("n, blocks", [(0, 0), (3, 0), (4, 1), (7, 1), (8, 2), (11, 2)])
def test_partial_block_is_not_hashed(n: int, blocks: int) -> None:
    tokens = list(range(1, n + 1))
    hashes = chain_hashes(tokens, 4, "tiny")
    assert len(hashes) == blocks
    assert [h.hex() for h in hashes] == [TINY_1234, TINY_5678][:blocks]


def test_sequence_hashes_match_chain_hashes_as_it_grows() -> None:
    seq = Sequence("r", [1, 2, 3, 4, 5, 6], SamplingParams(), arrival=0)
    assert [h.hex() for h in seq.update_block_hashes(4, "tiny")] == [TINY_1234]
    seq.token_ids += [7, 8, 9]
    assert [h.hex() for h in seq.update_block_hashes(4, "tiny")] == [TINY_1234, TINY_5678]
    assert seq.block_hashes == chain_hashes(seq.token_ids, 4, "tiny")
