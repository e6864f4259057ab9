"""Block reads and writes by runs of consecutive ids equal plain advanced indexing."""
from __future__ import annotations

import torch

from engine.model_runner import ModelRunner, _runs


def test_runs_split_consecutive_ids():
    assert _runs([4, 5, 6, 9, 2, 3, 11]) == [(0, 4, 3), (3, 9, 1), (4, 2, 2), (6, 11, 1)]
    assert _runs([]) == []


def test_read_and_write_blocks_match_indexing_for_scattered_ids():
    runner = ModelRunner.__new__(ModelRunner)  # only the KV cache is needed here
    runner.kv_cache = torch.randn(2, 3, 12, 4, 2, 8)
    ids = [7, 8, 2, 10, 11, 0]
    assert torch.equal(runner.read_blocks(ids), runner.kv_cache[:, :, ids])
    kv = torch.randn(2, 3, len(ids), 4, 2, 8)
    expected = runner.kv_cache.clone()
    expected[:, :, ids] = kv
    runner.write_blocks(ids, kv)
    assert torch.equal(runner.kv_cache, expected)


def test_decode_groups_bound_padding_and_keep_groups_large():
    from engine.model_runner import _groups

    lens = [10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 100]
    # The 9th decode (30 > 1.5 x 10) starts a new group once the first holds 8.
    assert _groups(lens) == [(0, 8), (8, 11)]
    assert _groups([5, 500]) == [(0, 2)]  # too few to split
    assert _groups([]) == []
