"""The simulated engine over the engine's real scheduler, pool and prefix cache: batching,
chunking and the prefill/decode hand-over, with every block accounted for."""
from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.messages import GenerateRequest
from engine.sampling import SamplingParams
from engine.sequence import SequenceStatus
from sim.cost import Roofline, StepWork
from sim.engine import OUT_TOKEN, SimEngine
from sim.hardware import load_device
from sim.shapes import load_shape

COST = Roofline(load_shape("tiny"), load_device("cpu-2core"))


def make_engine(role: str = "mixed", num_blocks: int = 64, budget: int = 64, seqs: int = 8) -> SimEngine:
    return SimEngine(role, SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget), num_blocks,
                     block_size=4, model_id="m", cost=COST, record_events=True)


def make_request(rid: str, prompt: list[int], max_tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def run_to_end(engine: SimEngine) -> list[list[tuple[str, int]]]:
    """Every step's batch as (request id, new tokens), until nothing is left to schedule."""
    steps = []
    while engine.has_work():
        batch, _ = engine.plan()
        assert batch, "work left that the scheduler cannot place"
        steps.append([(s.seq.request_id, s.num_new_tokens) for s in batch])
        engine.finish(batch)
    return steps


def test_chunked_prefill_then_batched_decode_frees_every_block() -> None:
    e = make_engine(budget=16)
    a, b = e.add(make_request("a", list(range(20)), 3)), e.add(make_request("b", list(range(100, 106)), 2))
    steps = run_to_end(e)
    # a's 20-token prompt is chunked at the 16-token budget; b fills the step after a's chunk.
    assert steps == [[("a", 16)], [("a", 4), ("b", 6)], [("b", 1), ("a", 1)], [("a", 1)]]  # decodes: shorter first
    assert a.output_token_ids == [OUT_TOKEN] * 3 and b.output_token_ids == [OUT_TOKEN] * 2
    assert a.status == b.status == SequenceStatus.FINISHED
    assert e.pool.num_referenced == 0  # nothing leaked; cached blocks stay evictable
    assert e.pool.num_free == e.pool.num_blocks


def test_a_shared_prefix_is_computed_once() -> None:
    e = make_engine()
    e.add(make_request("a", list(range(13)), 1))
    run_to_end(e)
    second = e.add(make_request("b", list(range(13)), 1))
    assert run_to_end(e) == [[("b", 1)]]  # 12 of 13 tokens cached: only the last one runs
    assert second.num_cached_tokens == 12
    assert e.pool.num_referenced == 0


def test_prefill_role_holds_blocks_until_the_decode_side_took_them() -> None:
    p, d = make_engine("prefill"), make_engine("decode")
    req = make_request("r", list(range(10)), 5)
    p.add(req)
    run_to_end(p)
    held = p.prefilled["r"].block_table
    assert len(held) == 3 and p.pool.num_referenced == 3
    assert d.reserve("r", 10) and d.pool.num_referenced == 3
    assert p.release("r") and p.pool.num_referenced == 0
    seq = d.admit(req, OUT_TOKEN, cached_tokens=0)
    steps = run_to_end(d)
    assert steps == [[("r", 1)]] * 4 and seq.output_token_ids == [OUT_TOKEN] * 5
    assert d.pool.num_referenced == 0


def test_abort_mid_step_and_a_refused_reservation_leak_nothing() -> None:
    e = make_engine(num_blocks=8)
    e.add(make_request("a", list(range(12)), 4))
    batch, _ = e.plan()
    assert e.abort("a")  # while the step is under way
    assert e.finish(batch) == []
    assert e.pool.num_referenced == 0
    assert not e.reserve("big", 40)  # 10 blocks of 8
    assert e.reserve("ok", 8) and e.abort("ok") and e.pool.num_referenced == 0


def test_preemption_under_memory_pressure_still_finishes_all() -> None:
    e = make_engine(num_blocks=10, budget=64, seqs=8)
    seqs = [e.add(make_request(f"r{i}", [i] * 8 + list(range(8)), 12)) for i in range(4)]
    run_to_end(e)
    assert e.scheduler.num_preemptions > 0
    assert all(s.output_token_ids == [OUT_TOKEN] * 12 for s in seqs)
    assert e.pool.num_referenced == 0


def test_steady_decode_repeats_equal_the_same_steps_one_by_one() -> None:
    def decode_engine() -> tuple[SimEngine, list]:
        e = make_engine("decode", num_blocks=64)
        seqs = []
        for i in range(3):
            req = make_request(f"r{i}", [i] * 6, 9 + i)
            assert e.reserve(req.request_id, 6)
            seqs.append(e.admit(req, OUT_TOKEN))
        return e, seqs

    (one, one_seqs), (many, many_seqs) = decode_engine(), decode_engine()
    one_times = []
    while one.has_work():
        batch, t = one.plan()
        one.finish(batch)
        one_times.append(t)
    passes, many_times = 0, []
    while many.has_work():
        batch, t = many.plan()
        steady = many.steady_steps(batch, cap=16)
        many.finish(batch, len(steady) or 1)
        many_times += steady or [t]
        passes += 1
    assert passes < len(one_times)  # fewer scheduler passes...
    assert [s.token_ids for s in many_seqs] == [s.token_ids for s in one_seqs]  # ...the same tokens
    assert many_times == pytest.approx(one_times)  # ...and the same step times
    assert many.pool.num_referenced == one.pool.num_referenced == 0


def test_decode_step_times_follow_the_context_exactly() -> None:
    steps = COST.decode_steps_s(4, 1000, 40)
    assert steps == pytest.approx([COST.step_s(StepWork.of([(1, 250 + j, True)] * 4)) for j in range(40)])


def test_host_tier_keeps_evicted_blocks_and_loads_them_back_at_link_speed() -> None:
    from sim.hardware import load_link

    e = make_engine(num_blocks=6, budget=64)
    link = load_link("pcie5-x16")
    e.attach_host(capacity_blocks=8, block_bytes=1 << 20, link=link)
    e.add(make_request("a", list(range(13)), 1))
    run_to_end(e)  # a's 3 full blocks cached on device
    e.add(make_request("b", list(range(100, 121)), 1))
    run_to_end(e)  # b needs 6 blocks: a's cached ones are evicted, into the host tier
    events = e.take_events()
    host_stored = [h for ev in events if ev.kind == "stored" and ev.tier == "host" for h in ev.hashes]
    assert len(host_stored) == 3 and len(e.host.blocks) == 3
    again = e.add(make_request("a2", list(range(13)), 1))
    batch, seconds = e.plan()
    assert [(s.seq.request_id, s.num_new_tokens) for s in batch] == [("a2", 1)]  # 12 tokens loaded, not computed
    assert again.cached_by_tier == {"host": 12}
    assert seconds == pytest.approx(COST.step_s(StepWork.of([(1, 12, True)])) + link.transfer_s(3 << 20))
    e.finish(batch)
    assert e.pool.num_referenced == 0 and e.host.stats["loaded"] == 3


def test_disk_tier_keeps_what_host_memory_lets_go_and_loads_it_back_at_disk_speed() -> None:
    from sim.hardware import load_link

    def evict_a(disk_blocks: int) -> SimEngine:
        e = make_engine(num_blocks=6, budget=64)
        e.attach_host(capacity_blocks=0, block_bytes=1 << 20, link=load_link("pcie5-x16"), disk_blocks=disk_blocks,
                      disk_link=disk)
        e.add(make_request("a", list(range(13)), 1))
        run_to_end(e)
        e.add(make_request("b", list(range(100, 121)), 1))
        run_to_end(e)  # a's 3 cached blocks are evicted: through host memory (no room there) to disk
        return e

    disk = load_link("nvme-gen4")
    e = evict_a(disk_blocks=8)
    events = [(ev.kind, ev.tier, len(ev.hashes)) for ev in e.take_events() if ev.tier != "device"]
    assert events == [("stored", "host", 3), ("stored", "disk", 3), ("removed", "host", 3)]  # new tier first
    again = e.add(make_request("a2", list(range(13)), 1))
    batch, seconds = e.plan()
    assert [(s.seq.request_id, s.num_new_tokens) for s in batch] == [("a2", 1)]  # 12 tokens read, not computed
    assert again.cached_by_tier == {"disk": 12}
    assert seconds == pytest.approx(COST.step_s(StepWork.of([(1, 12, True)])) + disk.transfer_s(3 << 20))
    assert e.host.stats["disk_loaded"] == 3 and e.host.stats["loaded"] == 0
    small = evict_a(disk_blocks=2)  # the disk's own LRU: one of a's blocks goes
    assert ("removed", "disk", 1) in [(ev.kind, ev.tier, len(ev.hashes)) for ev in small.take_events()]
    assert len(small.host.disk) == 2


def test_a_disk_tier_needs_its_link() -> None:
    e = make_engine()
    from sim.hardware import load_link

    with pytest.raises(ValueError, match="disk tier needs its link"):
        e.attach_host(0, 1 << 20, load_link("pcie5-x16"), disk_blocks=4)
