"""The real router driven end to end over simulated workers on the virtual clock: exact
timings on a tiny scenario, KV-aware routing by the in-memory index, no leaked blocks, and
the same records for the same seed."""
from __future__ import annotations

import asyncio

import pytest

from cluster.sim_bridge import from_loadtest
from loadtest.workloads import SharedPrefixWorkload
from sim.cost import Roofline, StepWork
from sim.fleet import FleetConfig, SimSession, simulate
from sim.hardware import load_device, load_link
from sim.shapes import load_shape

FLEET = FleetConfig(model="tiny", device="cpu-2core", prefill=2, decode=1, num_blocks=256, stream_every=1)
COST = Roofline(load_shape("tiny"), load_device("cpu-2core"))
LINK = load_link("gloo-loopback")


def prefill_s(new: int, cached: int = 0) -> float:
    return COST.step_s(StepWork.of([(new, cached, True)]))


def test_tiny_scenario_timings_routes_and_blocks_are_exact() -> None:
    shared = list(range(48))
    sessions = [
        SimSession("a", 0.0, ((shared + list(range(100, 116)), 4),)),
        SimSession("b", 1.0, ((shared + list(range(200, 216)), 2),)),  # a's first 3 blocks
        SimSession("c", 1.0, ((list(range(300, 364)), 2),)),  # nothing in common
    ]
    run = simulate(FLEET, sessions)
    rec = {r.request_id: r for r in run["records"]}
    assert run["completed"] == 3 and run["failed"] == 0
    # a: an idle fleet, so TTFT is its prefill step; then the KV crosses the link and the
    # decode worker runs one step per token (contexts 64, 65, 66).
    transfer = LINK.transfer_s(COST.kv_bytes(64))
    decode = [COST.step_s(StepWork.of([(1, 64 + j, True)])) for j in range(3)]
    a = rec["a"]
    assert a.ttft_s == pytest.approx(prefill_s(64))
    assert a.chunk_tokens == [1, 1, 1, 1] and a.output_tokens == 4
    assert a.e2e_s == pytest.approx(prefill_s(64) + transfer + sum(decode))
    # b: kv_aware sends it where a's prefix is cached, and only its last 16 tokens run.
    assert rec["b"].cached_tokens == 48 and rec["b"].ttft_s == pytest.approx(prefill_s(16, 48))
    assert rec["c"].cached_tokens == 0 and rec["c"].ttft_s == pytest.approx(prefill_s(64))
    workers = run["sim"]["workers"]
    assert workers["prefill-0"]["steps"] == 2 and workers["prefill-1"]["steps"] == 1  # a, b there; c alone
    assert run["sim"]["kv_picks"] == {"by_index": 3, "load_over_hit": 0}
    assert all(w["referenced_blocks"] == 0 and w["prefilled"] == 0 and w["reserved"] == 0 for w in workers.values())
    assert run["cache_hit_ratio"] == pytest.approx(48 / 192)


def test_round_robin_ignores_the_cache() -> None:
    fleet = FLEET.model_copy(update={"router": FLEET.router.model_copy(update={"policy": "round_robin"})})
    shared = list(range(48))
    sessions = [SimSession(f"s{i}", float(i), ((shared + [1000 + i] * 16, 2),)) for i in range(4)]
    run = simulate(fleet, sessions)
    assert [r.cached_tokens for r in run["records"]] == [0, 0, 48, 48]  # alternating over two workers


def test_colocated_fleet_streams_every_token() -> None:
    fleet = FLEET.model_copy(update={"mode": "colocated", "prefill": 1, "decode": 0})
    run = simulate(fleet, [SimSession("x", 0.0, ((list(range(32)), 3),))])
    (r,) = run["records"]
    assert r.ttft_s == pytest.approx(prefill_s(32))
    assert r.output_tokens == 3 and r.e2e_s == pytest.approx(
        prefill_s(32) + sum(COST.step_s(StepWork.of([(1, 32 + j, True)])) for j in range(2)))


def test_the_same_seed_gives_the_same_run() -> None:
    workload = SharedPrefixWorkload(num_groups=3, prompts_per_group=4, system_prompt_len=64, question_len=16,
                                    output_len=8, seed=5)

    def once() -> list:
        run = simulate(FLEET, from_loadtest(workload, rate=20.0), slo={"ttft": 0.5})
        return [(r.request_id, r.start_s, r.ttft_s, r.e2e_s, r.cached_tokens, r.chunk_times_s) for r in run["records"]]

    first = once()
    assert len(first) == 12 and first == once()
    other = SharedPrefixWorkload(**{**workload.model_dump(), "seed": 6})
    moved = simulate(FLEET, from_loadtest(other, 20.0))["records"]
    assert [r[1] for r in first] != [r.start_s for r in moved]  # another seed, other arrivals


@pytest.mark.parametrize("dead", ["decode-0", "prefill-0"])
def test_a_worker_dying_mid_run_migrates_its_requests(dead: str) -> None:
    fleet = FLEET.model_copy(update={"prefill": 2, "decode": 2, "failures": ((dead, 0.3),)})
    sessions = [SimSession(f"s{i}", 0.05 * i, ((list(range(i, i + 64)), 40),)) for i in range(12)]
    run = simulate(fleet, sessions)
    assert run["completed"] == 12 and run["failed"] == 0
    assert [r.output_tokens for r in run["records"]] == [40] * 12  # every token once, none lost or repeated
    assert all(sum(r.chunk_tokens) == 40 for r in run["records"])
    workers = run["sim"]["workers"]
    assert workers[dead]["alive"] is False
    assert all(w["referenced_blocks"] == 0 for wid, w in workers.items() if wid != dead)  # the living leak nothing
    assert workers[dead]["steps"] > 0  # it did work before it died...
    assert sum(r.migrations for r in run["records"]) > 0  # ...and some requests moved off it


def test_a_failure_of_an_unknown_worker_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown worker 'decode-9'"):
        simulate(FLEET.model_copy(update={"failures": (("decode-9", 1.0),)}), [SimSession("a", 0.0, (([1] * 8, 2),))])


def test_a_prefix_evicted_to_the_host_tier_is_loaded_back_not_recomputed() -> None:
    sessions = [SimSession("a", 0.0, ((list(range(64)), 2),)), SimSession("b", 1.0, ((list(range(500, 621)), 2),)),
                SimSession("a-again", 2.0, ((list(range(64)), 2),))]
    small = FLEET.model_copy(update={"prefill": 1, "decode": 1, "num_blocks": 8})
    without = {r.request_id: r.cached_tokens for r in simulate(small, sessions)["records"]}
    run = simulate(small.model_copy(update={"host_tier_bytes": 1e6}), sessions)
    with_host = {r.request_id: r.cached_tokens for r in run["records"]}
    assert without == {"a": 0, "b": 0, "a-again": 0}  # b evicted a's blocks from the 8-block pool
    assert with_host == {"a": 0, "b": 0, "a-again": 48}  # they waited in host memory
    assert run["sim"]["workers"]["prefill-0"]["host_tier"]["loaded"] == 3


def test_the_random_policy_follows_the_fleet_seed() -> None:
    sessions = [SimSession(f"s{i}", 0.01 * i, ((list(range(i * 100, i * 100 + 32)), 2),)) for i in range(16)]

    def picks(seed: int) -> list:
        fleet = FLEET.model_copy(update={"seed": seed, "router": FLEET.router.model_copy(update={"policy": "random"})})
        return [w["steps"] for w in simulate(fleet, sessions)["sim"]["workers"].values()]

    assert picks(1) == picks(1)
    assert any(picks(s) != picks(1) for s in (2, 3, 4))


def test_a_prefix_on_the_disk_tier_is_read_back_and_the_router_sees_its_tier() -> None:
    sessions = [SimSession("a", 0.0, ((list(range(64)), 2),)), SimSession("b", 1.0, ((list(range(500, 621)), 2),)),
                SimSession("a-again", 2.0, ((list(range(64)), 2),))]
    small = FLEET.model_copy(update={"prefill": 1, "decode": 1, "num_blocks": 8, "disk_tier_bytes": 1e6})
    run = simulate(small, sessions)  # no host memory: what the device pool evicts goes to disk
    assert {r.request_id: r.cached_tokens for r in run["records"]} == {"a": 0, "b": 0, "a-again": 48}
    tier = run["sim"]["workers"]["prefill-0"]["host_tier"]
    assert tier["disk_loaded"] == 3 and tier["loaded"] == 0


def test_a_reservation_waits_for_the_decode_step_in_flight() -> None:
    """As the real decode worker's engine loop, which runs a reservation between steps."""
    transfer = LINK.transfer_s(COST.kv_bytes(64))
    d0 = COST.step_s(StepWork.of([(1, 64, True)]))
    b_at = prefill_s(64) + transfer + d0 / 2  # halfway through a's first decode step
    sessions = [SimSession("a", 0.0, ((list(range(64)), 20),)), SimSession("b", b_at, ((list(range(500, 564)), 2),))]
    rec = {r.request_id: r for r in simulate(FLEET, sessions)["records"]}
    assert rec["b"].ttft_s == pytest.approx(d0 / 2 + prefill_s(64))


class _HalfSpeed:
    """A StepHost whose steps take twice their modelled time, one at a time, each recorded."""

    steady = False

    def __init__(self) -> None:
        self.steps: list[tuple[float, bool, int]] = []

    async def step(self, seconds: float, *, prompt: bool, decode: int) -> None:
        self.steps.append((seconds, prompt, decode))
        await asyncio.sleep(2 * seconds)


def test_every_step_runs_through_the_fleets_one_host() -> None:
    """simulate(host=...) puts every worker's steps on the one host it makes (the seam a
    shared machine's model plugs into); the default host is a device of each worker's own."""
    sessions = [SimSession("a", 0.0, ((list(range(64)), 4),))]
    hosts: list[_HalfSpeed] = []

    def make() -> _HalfSpeed:
        hosts.append(_HalfSpeed())
        return hosts[-1]

    plain = simulate(FLEET, sessions)["records"][0]
    (slow,) = simulate(FLEET, sessions, host=make)["records"]
    assert len(hosts) == 1
    host = hosts[0]
    assert host.steps[0] == (pytest.approx(prefill_s(64)), True, 0)
    assert [p for _, p, _ in host.steps[1:]] == [False] * 3 and all(d == 1 for _, _, d in host.steps[1:])
    assert slow.ttft_s == pytest.approx(2 * plain.ttft_s)
    transfer = LINK.transfer_s(COST.kv_bytes(64))
    assert slow.e2e_s - slow.ttft_s == pytest.approx(2 * (plain.e2e_s - plain.ttft_s - transfer) + transfer)


def test_a_steady_host_advances_a_decode_batch_as_its_steps_would() -> None:
    """The default host repeats a steady decode batch by arithmetic; a host that says it is not
    steady gets every step: the records are the same when both take the modelled time."""

    calls = []

    class OneByOne:
        steady = False

        async def step(self, seconds: float, *, prompt: bool, decode: int) -> None:
            calls.append(seconds)
            await asyncio.sleep(seconds)

    fleet = FLEET.model_copy(update={"stream_every": 16})
    sessions = [SimSession(f"s{i}", 0.05 * i, ((list(range(100 * i, 100 * i + 64)), 40),)) for i in range(3)]
    fast, slow = simulate(fleet, sessions), simulate(fleet, sessions, host=OneByOne)
    for a, b in zip(fast["records"], slow["records"]):
        assert a.chunk_times_s == pytest.approx(b.chunk_times_s) and a.e2e_s == pytest.approx(b.e2e_s)
    steps = sum(w["steps"] for w in slow["sim"]["workers"].values())
    assert len(calls) == steps == sum(w["steps"] for w in fast["sim"]["workers"].values())
