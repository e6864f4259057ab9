"""Workload generators and arrival processes: seeded determinism, token-level prefix structure,
and the Mooncake trace (the shared file) loaded, selected and scaled."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from shared_data import SHARED_DATA, shared_data

from loadtest.arrivals import arrival_offsets
from loadtest.records import TraceFormatError, load_rows
from loadtest.types import Session, Turn
from loadtest.workloads import (
    MultiTurnWorkload,
    RandomWorkload,
    SharedPrefixWorkload,
    TraceWorkload,
    build_sessions,
)
from loadtest.workloads.tokens import FIRST_ID, as_text, sample_lengths

# The shared Mooncake conversation trace, next to the repository (../shared/data/).
TRACE_NAME = "mooncake_conversation_trace.jsonl"
TRACE = SHARED_DATA / TRACE_NAME

CONFIGS = [RandomWorkload(num_prompts=20, input_len="8:64", output_len="normal:16,4"),
           SharedPrefixWorkload(num_groups=3, prompts_per_group=4, system_prompt_len=48, question_len=8),
           MultiTurnWorkload(num_sessions=3, num_turns=3, input_len="4,8,16", system_prompt_len=10),
           TraceWorkload(path=TRACE, num_prompts=30, length_scale=1 / 32)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.kind)
def test_the_same_seed_gives_the_same_requests(cfg) -> None:
    if cfg.kind == "trace":
        shared_data(TRACE_NAME)
    first, again = build_sessions(cfg), build_sessions(cfg)
    assert first == again
    other = build_sessions(cfg.model_copy(update={"seed": 1}))
    assert [s.turns for s in other] != [s.turns for s in first]
    assert [len(t.content) for s in other for t in s.turns] == [len(t.content) for s in first for t in s.turns] \
        or cfg.kind in ("random", "multi-turn")  # lengths are drawn too where they are random
    for s in first:
        for t in s.turns:
            assert all(FIRST_ID <= i < cfg.vocab_size for i in t.content)


def test_random_lengths_follow_the_spec() -> None:
    sessions = build_sessions(RandomWorkload(num_prompts=200, input_len="8:64", output_len="7"))
    inputs = [len(s.turns[0].content) for s in sessions]
    assert min(inputs) >= 8 and max(inputs) <= 64 and len(set(inputs)) > 20
    assert {s.turns[0].output_len for s in sessions} == {7}
    assert set(sample_lengths("3,9", 50, np.random.default_rng(0))) == {3, 9}
    with pytest.raises(ValueError, match="bad length '5:2'"):
        RandomWorkload(input_len="5:2")


def test_shared_prefix_groups_share_the_system_prompt_token_for_token() -> None:
    cfg = SharedPrefixWorkload(num_groups=3, prompts_per_group=4, system_prompt_len=48, question_len=8,
                               output_len=5, num_turns=2)
    sessions = build_sessions(cfg)
    assert len(sessions) == 12
    # Interleaved: q0 of every group, then q1, ...
    assert [s.id for s in sessions[:4]] == ["group0-q0", "group1-q0", "group2-q0", "group0-q1"]
    groups: dict[str, list[Session]] = {}
    for s in sessions:
        groups.setdefault(s.id.split("-")[0], []).append(s)
    systems = {g: ss[0].system for g, ss in groups.items()}
    for g, ss in groups.items():
        assert all(s.system == systems[g] and len(s.system) == 48 for s in ss)
        assert all(len(s.turns) == 2 and all(len(t.content) == 8 and t.output_len == 5 for t in s.turns) for s in ss)
    assert len({tuple(v) for v in systems.values()}) == 3  # groups do not share
    assert systems["group0"][0] != systems["group1"][0] or systems["group0"][1] != systems["group1"][1]
    questions = [tuple(t.content) for s in sessions for t in s.turns]
    assert len(set(questions)) == len(questions)


def test_text_prompts_keep_the_shared_prefix_as_a_text_prefix() -> None:
    ids = build_sessions(SharedPrefixWorkload(num_groups=2, prompts_per_group=2, system_prompt_len=20))
    text = build_sessions(SharedPrefixWorkload(num_groups=2, prompts_per_group=2, system_prompt_len=20,
                                               prompt_format="text"))
    assert [s.system for s in text] == [as_text(s.system) for s in ids]
    assert all(len(s.system.split()) == 20 for s in text)


def test_multi_turn_sessions() -> None:
    sessions = build_sessions(MultiTurnWorkload(num_sessions=3, num_turns=4, input_len="4,8", output_len="5",
                                                think_time_s=0.5))
    assert len(sessions) == 3 and all(len(s.turns) == 4 and s.think_time_s == 0.5 for s in sessions)
    assert all(s.system is None for s in sessions)
    assert {len(t.content) for s in sessions for t in s.turns} <= {4, 8}


# -- the Mooncake trace ------------------------------------------------------------------------


def test_trace_rows_become_token_blocks_shared_by_hash_id() -> None:
    shared_data(TRACE_NAME)
    rows = load_rows(TRACE)[:50]
    sessions = build_sessions(TraceWorkload(path=TRACE, num_prompts=50))
    assert [len(s.turns[0].content) for s in sessions] == [r["input_length"] for r in rows]
    assert [s.turns[0].output_len for s in sessions] == [r["output_length"] for r in rows]
    # Requests share exactly the blocks their hash ids share.
    pairs = 0
    for i in range(len(rows)):
        for j in range(i):
            a, b = rows[i]["hash_ids"], rows[j]["hash_ids"]
            common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            pa, pb = sessions[i].turns[0].content, sessions[j].turns[0].content
            n = min(common * 512, len(pa), len(pb))
            assert pa[:n] == pb[:n]
            if common < min(len(a), len(b)):
                assert pa[common * 512:(common + 1) * 512] != pb[common * 512:(common + 1) * 512]
            pairs += common > 0
    assert pairs > 0  # the shared trace does share prefixes (hash id 0 starts many requests)


def test_trace_scaling_and_selection() -> None:
    shared_data(TRACE_NAME)
    rows = load_rows(TRACE)
    cfg = TraceWorkload(path=TRACE, start_s=60, window_s=30, length_scale=1 / 32, output_scale=0.5, time_scale=0.1)
    sessions = build_sessions(cfg)
    chosen = [r for r in rows if 60 <= r["timestamp"] / 1000 < 90]
    assert len(sessions) == len(chosen) > 0
    for s, r in zip(sessions, chosen):
        n = len(s.turns[0].content)
        assert (len(r["hash_ids"]) - 1) * 16 < n <= len(r["hash_ids"]) * 16  # blocks of 512 / 32 = 16 tokens
        assert n == min(len(r["hash_ids"]) * 16, max((len(r["hash_ids"]) - 1) * 16 + 1,
                                                       math.ceil(r["input_length"] / 32)))
        assert s.turns[0].output_len == max(1, round(r["output_length"] * 0.5))
        assert s.arrival_s == pytest.approx((r["timestamp"] / 1000 - 60) * 0.1)
    assert len(build_sessions(cfg.model_copy(update={"num_prompts": 5}))) == 5


def test_trace_format_errors_name_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}) + "\n"
                   + json.dumps({"timestamp": 0, "input_length": 5}) + "\n")
    with pytest.raises(TraceFormatError, match="bad.jsonl:2: expected a JSON object"):
        build_sessions(TraceWorkload(path=bad))


# -- arrivals ----------------------------------------------------------------------------------


def _sessions(n: int) -> list[Session]:
    return [Session(str(i), (Turn([20], 1),)) for i in range(n)]


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_burstiness() -> None:
    n, rate = 20000, 4.0
    poisson = np.diff(arrival_offsets(_sessions(n), rate, "poisson", 1.0, seed=0))
    assert poisson.mean() == pytest.approx(1 / rate, rel=0.03)
    assert (poisson.std() / poisson.mean()) ** 2 == pytest.approx(1.0, rel=0.05)  # exponential: CV^2 = 1
    bursty = np.diff(arrival_offsets(_sessions(n), rate, "poisson", 0.25, seed=0))
    assert bursty.mean() == pytest.approx(1 / rate, rel=0.05)
    assert (bursty.std() / bursty.mean()) ** 2 == pytest.approx(4.0, rel=0.1)  # gamma: CV^2 = 1 / shape
    assert arrival_offsets(_sessions(50), rate, "poisson", 1.0, 7) == arrival_offsets(_sessions(50), rate,
                                                                                       "poisson", 1.0, 7)


def test_fixed_infinite_and_trace_arrivals() -> None:
    assert arrival_offsets(_sessions(4), 2.0, "fixed", 1.0, 0) == [0.0, 0.5, 1.0, 1.5]
    assert arrival_offsets(_sessions(3), math.inf, "poisson", 1.0, 0) == [0.0, 0.0, 0.0]
    timed = [Session("a", (Turn([20], 1),), arrival_s=0.0), Session("b", (Turn([20], 1),), arrival_s=2.5)]
    assert arrival_offsets(timed, 1.0, "trace", 1.0, 0) == [0.0, 2.5]
    with pytest.raises(ValueError, match="arrival 'trace' needs timestamps"):
        arrival_offsets(_sessions(2), 1.0, "trace", 1.0, 0)
