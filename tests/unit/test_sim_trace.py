"""Mooncake trace replay: rows become requests with the trace's block structure, scaled, and
the ideal hit ratio counts what one infinite cache would find."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from sim.trace import TraceFormatError, ideal_hit_ratio, load_trace

ROWS = [
    {"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [0, 1, 2]},
    {"timestamp": 500, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 3]},
    {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [7, 8]},
]


def write(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_become_requests_whose_tokens_share_the_traces_prefixes(tmp_path: Path) -> None:
    reqs = load_trace(write(tmp_path, ROWS))
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 2.0]
    assert [len(r.prompt) for r in reqs] == [1100, 1500, 600] and [r.output_len for r in reqs] == [10, 20, 5]
    a, b = reqs[0].prompt.tokens(), reqs[1].prompt.tokens()
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]  # ids 0, 1 shared; 2 vs 3 not
    assert a[:512] == [0] * 512 and len(list(reqs[2].prompt)) == 600


def test_scaling_keeps_the_sharing(tmp_path: Path) -> None:
    reqs = load_trace(write(tmp_path, ROWS), length_scale=0.125, output_scale=2, time_scale=0.5, num_prompts=2)
    assert [r.prompt.block for r in reqs] == [64, 64]
    assert [len(r.prompt) for r in reqs] == [138, 188] and [r.output_len for r in reqs] == [20, 40]
    assert [r.arrival_s for r in reqs] == [0.0, 0.25]
    window = load_trace(write(tmp_path, ROWS), start_s=0.4, window_s=1.0)
    assert [(r.request_id, r.arrival_s) for r in window] == [("trace-0", pytest.approx(0.1))]


def test_ideal_hit_ratio_counts_leading_blocks_seen_before(tmp_path: Path) -> None:
    reqs = load_trace(write(tmp_path, ROWS))
    # Only the second request hits: ids 0 and 1 (1024 tokens) of 1100 + 1500 + 600 tokens.
    assert ideal_hit_ratio(reqs) == pytest.approx(1024 / 3200)
    # An id seen before under another prefix is not a hit: chains, not ids, are cached.
    other = load_trace(write(tmp_path, [ROWS[0], {**ROWS[2], "hash_ids": [5, 1, 2]}]))
    assert ideal_hit_ratio(other) == 0.0


def test_a_bad_row_names_its_line(tmp_path: Path) -> None:
    path = write(tmp_path, ROWS[:1])
    path.write_text(path.read_text() + '{"timestamp": 1, "input_length": 5}\n')
    with pytest.raises(TraceFormatError, match="trace.jsonl:2"):
        load_trace(path)
    with pytest.raises(ValueError, match="scales"):
        load_trace(write(tmp_path, ROWS), time_scale=0)
