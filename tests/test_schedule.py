"""Scheduler.schedule() with no model: the builders (tests/helpers.py make_scheduler,
make_seqs, step) drive it step by step, and every step is checked to the block id."""
from __future__ import annotations

from helpers import make_scheduler, make_seqs, step

PREFIX = list(range(1, 9))  # two full blocks of 4


def test_prompts_then_decodes_shortest_context_first():
    sched = make_scheduler(block_size=4, budget=16)
    for seq in make_seqs(6, 5):
        sched.add(seq)
    assert step(sched) == [("s0", 6, [0, 1]), ("s1", 5, [2, 3])]
    assert step(sched) == [("s1", 1, [2, 3]), ("s0", 1, [0, 1])]  # decodes, by context: s1 has 6, s0 7
    assert step(sched) == [("s1", 1, [2, 3]), ("s0", 1, [0, 1])]
    assert step(sched) == [("s1", 1, [2, 3]), ("s0", 1, [0, 1, 4])]  # s0's 9th token opens a block


def test_a_long_prompt_is_chunked_to_the_budget_and_a_newcomer_takes_the_rest():
    sched = make_scheduler(block_size=4, budget=16)
    [long] = make_seqs(20)
    sched.add(long)
    assert step(sched) == [("s0", 16, [0, 1, 2, 3])]
    assert long.num_computed == 16 and long.num_tokens == 20  # no token sampled mid-prompt
    [late] = make_seqs(10, start=1)
    sched.add(late)
    assert step(sched) == [("s0", 4, [0, 1, 2, 3, 4]), ("s1", 10, [5, 6, 7])]


def test_without_chunking_a_prompt_over_the_budget_waits_and_so_does_the_queue_behind_it():
    sched = make_scheduler(block_size=4, budget=16, chunked=False)
    for seq in make_seqs(20, 3):
        sched.add(seq)
    assert step(sched) == []
    assert [s.request_id for s in sched.waiting] == ["s0", "s1"]


def test_out_of_blocks_the_newest_running_sequence_is_preempted_and_its_blocks_reused():
    sched = make_scheduler(num_blocks=4, block_size=4, budget=16, prefix_cache=False)
    a, b = make_seqs(8, 8)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("s0", 8, [0, 1]), ("s1", 8, [2, 3])]
    assert step(sched) == [("s0", 1, [0, 1, 2])]  # b gave its blocks back; nothing else admitted this step
    assert (b.block_table, b.num_computed, b.num_preemptions, sched.num_preemptions) == ([], 0, 1, 1)
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert step(sched) == [("s0", 1, [0, 1, 2])]  # b's recompute needs 3 blocks; 1 is free
    assert sched.pool.free_list == type(sched.pool.free_list)([3])


def test_a_cached_prefix_is_shared_by_block_id_and_only_the_rest_is_computed():
    sched = make_scheduler(num_blocks=16, block_size=4, budget=16)
    [a] = make_seqs(2, prefix=PREFIX)
    sched.add(a)
    assert step(sched) == [("s0", 10, [0, 1, 2])]
    [b] = make_seqs(3, prefix=PREFIX, start=1)
    sched.add(b)
    assert step(sched) == [("s0", 1, [0, 1, 2]), ("s1", 3, [0, 1, 3])]
    assert b.num_cached_tokens == 8 and sched.pool.ref_counts[:4] == [2, 2, 1, 1]


def test_the_sequence_cap_holds_the_rest_back():
    sched = make_scheduler(block_size=4, budget=16, max_num_seqs=2)
    for seq in make_seqs(2, 2, 2):
        sched.add(seq)
    assert step(sched) == [("s0", 2, [0]), ("s1", 2, [1])]
    assert [s.request_id for s in sched.waiting] == ["s2"]
