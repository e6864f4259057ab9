"""The real router driven end to end over simulated workers on the virtual clock: exact
timings on a tiny scenario, KV-aware routing by the in-memory index, no leaked blocks, and
the same records for the same seed."""
from __future__ import annotations

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


def _profile(tmp_path, **fields) -> str:
    path = tmp_path / f"profile-{len(list(tmp_path.iterdir()))}.json"
    path.write_text(load_device("cpu-2core").model_copy(update=fields).model_dump_json())
    return str(path)


def test_a_profiles_request_overhead_is_in_every_ttft_and_e2e(tmp_path) -> None:
    """Half on the way in (before the router sees the request), half on the way back; a fixed
    part, one per prompt token (both prompts here are 64 tokens) and a disaggregated fleet's handoff."""
    overhead = 0.030 + 64 * 1e-4 + 0.005
    profile = _profile(tmp_path, request_overhead_s=0.030, request_overhead_per_token_s=1e-4, handoff_overhead_s=0.005)
    fleet = FLEET.model_copy(update={"device": profile})
    sessions = [SimSession("a", 0.0, ((list(range(64)), 3),)), SimSession("b", 5.0, ((list(range(300, 364)), 3),))]
    plain = {r.request_id: r for r in simulate(FLEET, sessions)["records"]}
    slow = {r.request_id: r for r in simulate(fleet, sessions)["records"]}
    for rid in ("a", "b"):
        assert slow[rid].ttft_s == pytest.approx(plain[rid].ttft_s + overhead)
        assert slow[rid].e2e_s == pytest.approx(plain[rid].e2e_s + overhead)
        assert slow[rid].output_tokens == plain[rid].output_tokens == 3


def test_a_profiles_jitter_spreads_lone_requests_about_their_median(tmp_path) -> None:
    """Each request draws its serving path's time about the median from the profile's
    quantiles (a wait above it, less work below): lone requests' TTFTs spread as measured,
    their median where it was, the same draws for the same seed."""
    jitter = (-0.004, -0.002, 0.0, 0.003, 0.012)
    plain = FLEET.model_copy(update={"device": _profile(tmp_path, request_overhead_s=0.010, host_cores=8)})
    spread = plain.model_copy(update={"device": _profile(tmp_path, request_overhead_s=0.010, host_cores=8,
                                                         request_jitter_s=jitter)})
    prompt = list(range(64))
    sessions = [SimSession(f"r{i}", 2.0 * i, ((prompt, 2),)) for i in range(41)]  # one at a time, all hits after r0

    def ttfts(fleet: FleetConfig) -> list[float]:
        return [r.ttft_s for r in sorted(simulate(fleet, sessions)["records"], key=lambda r: r.start_s)][1:]

    base, got = ttfts(plain), ttfts(spread)
    assert max(base) - min(base) == pytest.approx(0.0, abs=1e-9)
    extra = sorted(g - base[0] for g in got)
    assert extra[0] >= -0.004 - 1e-9 and extra[-1] <= 0.012 + 1e-9
    assert extra[-1] - extra[0] > 0.010  # spread over most of the quantiles' range
    assert extra[len(extra) // 2] == pytest.approx(0.0, abs=0.0015)  # about the median
    assert ttfts(spread) == got
    assert ttfts(spread.model_copy(update={"seed": 1})) != got


def test_a_reservation_waits_for_the_decode_step_in_flight() -> None:
    """As the real decode worker's engine loop, which runs a reservation between steps."""
    transfer = LINK.transfer_s(COST.kv_bytes(64))
    d0 = COST.step_s(StepWork.of([(1, 64, True)]))
    b_at = prefill_s(64) + transfer + d0 / 2  # halfway through a's first decode step
    sessions = [SimSession("a", 0.0, ((list(range(64)), 20),)), SimSession("b", b_at, ((list(range(500, 564)), 2),))]
    rec = {r.request_id: r for r in simulate(FLEET, sessions)["records"]}
    assert rec["b"].ttft_s == pytest.approx(d0 / 2 + prefill_s(64))


def test_workers_beyond_the_hosts_cores_share_them(tmp_path) -> None:
    """Two mixed workers prefilling at once: on two cores each step takes its own time, on one
    core both take twice as long."""
    sessions = [SimSession(s, 0.0, ((list(range(k, k + 64)), 1),)) for s, k in (("a", 0), ("b", 500))]
    colocated = FLEET.model_copy(update={"mode": "colocated", "prefill": 2, "decode": 0})
    for cores, stretch in ((2, 1), (1, 2)):
        fleet = colocated.model_copy(update={"device": _profile(tmp_path, host_cores=cores)})
        run = simulate(fleet, sessions)
        assert sorted(r.ttft_s for r in run["records"]) == pytest.approx([stretch * prefill_s(64)] * 2)


def test_the_serves_idle_cores_are_its_processes_and_each_workers(tmp_path) -> None:
    """Two mixed workers prefilling at once on two cores, the serve keeping 0.1 busy and each
    worker 0.05 more: their steps share the 1.8 cores left, each at 0.9 of its own time's speed."""
    sessions = [SimSession(s, 0.0, ((list(range(k, k + 64)), 1),)) for s, k in (("a", 0), ("b", 500))]
    colocated = FLEET.model_copy(update={"mode": "colocated", "prefill": 2, "decode": 0})
    busy = {"background_cores": 0.1, "worker_background_cores": 0.05}
    fleet = colocated.model_copy(update={"device": _profile(tmp_path, host_cores=2, **busy)})
    run = simulate(fleet, sessions)
    assert sorted(r.ttft_s for r in run["records"]) == pytest.approx([prefill_s(64) / 0.9] * 2)
    alone = simulate(fleet, sessions[:1])  # one step beside the polling still has a core of its own
    assert alone["records"][0].ttft_s == pytest.approx(prefill_s(64))


def test_streaming_work_slows_the_steps_only_when_the_cores_run_short(tmp_path) -> None:
    """The serving path's CPU per streamed token runs beside the worker: on a spare core it
    costs the worker nothing; on the worker's only core every step waits for its share."""
    sessions = [SimSession("x", 0.0, ((list(range(32)), 8),))]
    colocated = FLEET.model_copy(update={"mode": "colocated", "prefill": 1, "decode": 0})
    e2e = {}
    for cores, stream_cpu_s in ((2, 0.0), (2, 0.002), (1, 0.002)):
        fleet = colocated.model_copy(update={"device": _profile(tmp_path, host_cores=cores, stream_cpu_s=stream_cpu_s)})
        (r,) = simulate(fleet, sessions)["records"]
        e2e[(cores, stream_cpu_s)] = r.e2e_s
    assert e2e[(2, 0.002)] == pytest.approx(e2e[(2, 0.0)])
    assert e2e[(1, 0.002)] > e2e[(2, 0.0)] + 0.002  # at least a few tokens' streaming shared the core
    assert e2e[(1, 0.002)] < e2e[(2, 0.0)] + 8 * 0.002 + 1e-9  # never more than all of it


def test_a_decode_worker_takes_the_kv_in_on_the_hosts_cores(tmp_path) -> None:
    """Its pull thread's CPU per KV token, after the link's time: alone on a host with a spare
    core, the request's second token comes exactly that much later, its first not at all."""
    sessions = [SimSession("a", 0.0, ((list(range(64)), 3),))]
    plain = FLEET.model_copy(update={"device": _profile(tmp_path, host_cores=3)})
    taking = FLEET.model_copy(update={"device": _profile(tmp_path, host_cores=3, kv_receive_cpu_per_token_s=1e-4)})
    (p,), (t,) = simulate(plain, sessions)["records"], simulate(taking, sessions)["records"]
    assert t.ttft_s == pytest.approx(p.ttft_s)
    assert t.e2e_s == pytest.approx(p.e2e_s + 64 * 1e-4)


def test_a_decode_workers_admit_overhead_delays_the_second_token_only(tmp_path) -> None:
    """The calls and wake-ups between a request's first token and the decode worker taking it in:
    before the pull, so its second token (and every later one) comes that much later."""
    sessions = [SimSession("a", 0.0, ((list(range(64)), 3),))]
    plain = FLEET.model_copy(update={"device": _profile(tmp_path)})
    slow = FLEET.model_copy(update={"device": _profile(tmp_path, decode_admit_overhead_s=0.025)})
    (p,), (s,) = simulate(plain, sessions)["records"], simulate(slow, sessions)["records"]
    assert s.ttft_s == pytest.approx(p.ttft_s)
    assert s.chunk_times_s[1] - s.chunk_times_s[0] == pytest.approx(p.chunk_times_s[1] - p.chunk_times_s[0] + 0.025)
    assert s.e2e_s == pytest.approx(p.e2e_s + 0.025)
    colocated = plain.model_copy(update={"mode": "colocated", "device": _profile(tmp_path, decode_admit_overhead_s=1)})
    (c,) = simulate(colocated, sessions)["records"]  # no decode worker takes a request in: no such wait
    assert c.e2e_s < 1


def test_a_decode_workers_admit_overhead_is_work_on_a_cpu_hosts_cores(tmp_path) -> None:
    """On a CPU host the decode worker's calls that take a request in run on the cores the steps
    share (a request's decode-worker CPU, measured, held them: 23 ms for a 2-token answer whose one
    step took 12): a prompt computed while another request is being taken in shares its core with
    that, where a host with cores to spare runs both at full speed."""
    def second_ttft(cores: float, admit_s: float) -> float:
        device = _profile(tmp_path, host_cores=cores, decode_admit_overhead_s=admit_s, peak_flops=2e8)
        fleet = FLEET.model_copy(update={"prefill": 1, "device": device})
        a = SimSession("a", 0.0, ((list(range(64)), 3),))
        first = simulate(fleet, [a])["records"][0].ttft_s
        # b arrives as a's first token does: its prompt step runs while a is taken in
        sessions = [a, SimSession("b", first, ((list(range(300, 364)), 3),))]
        return {r.session_id: r for r in simulate(fleet, sessions)["records"]}["b"].ttft_s

    assert second_ttft(1, 0.025) > second_ttft(1, 0.0) + 0.005
    assert second_ttft(4, 0.025) == pytest.approx(second_ttft(4, 0.0), abs=1e-4)


def test_a_colocated_fleet_takes_the_corun_ceiling_and_not_the_waits(tmp_path) -> None:
    """A prompt sent while another request's answer decodes: a disaggregated fleet's prefill
    worker waits (its hit's way through the busy decode worker) and runs under the ceiling; a
    colocated worker beside the other colocated worker's answer runs under the ceiling (the
    threads each streamed token wakes) and does not wait (measured per request, its hits grew
    less than half as much beside one answer)."""
    sessions = [SimSession("a", 0.0, ((list(range(64)), 200),)), SimSession("b", 0.1, ((list(range(500, 564)), 2),))]
    waits = {"corun_wait_s": 0.02, "corun_wait_per_answer_s": 0.01}
    ceiling = {"corun_slowdown": 2.0}
    colocated = FLEET.model_copy(update={"mode": "colocated", "prefill": 2, "decode": 0})

    def ttft(fleet: FleetConfig, **terms) -> float:
        run = simulate(fleet.model_copy(update={"device": _profile(tmp_path, host_cores=2, **terms)}), sessions)
        rec = {r.request_id: r for r in run["records"]}
        assert rec["a"].output_tokens == 200 and rec["a"].e2e_s > 0.1 + rec["b"].ttft_s  # b ran beside a's answer
        return rec["b"].ttft_s

    for fleet in (FLEET, colocated):
        assert ttft(fleet, **ceiling) > ttft(fleet) + 0.5 * prefill_s(64)
    assert ttft(FLEET, **waits, **ceiling) == pytest.approx(ttft(FLEET, **ceiling) + 0.02)
    assert ttft(colocated, **waits, **ceiling) == pytest.approx(ttft(colocated, **ceiling))


def test_a_request_after_idle_takes_the_profiles_cold_step_and_request(tmp_path) -> None:
    """A request that finds the host idle a second or more takes cold_request_s's last extra on
    its serving path and its worker's first step cold_step_s's; the next turn, sent as the first
    answer ends, finds both warm."""
    cold = {"cold_step_s": ((1.0, 0.004),), "cold_request_s": ((1.0, 0.010),)}
    colocated = FLEET.model_copy(update={"mode": "colocated", "prefill": 1, "decode": 0})
    sessions = [SimSession("a", 0.0, ((list(range(64)), 3),)),
                SimSession("b", 5.0, ((list(range(300, 364)), 3), (list(range(400, 432)), 3)))]

    def run(**fields) -> dict:
        fleet = colocated.model_copy(update={"device": _profile(tmp_path, host_cores=8, **fields)})
        return {r.request_id: r for r in simulate(fleet, sessions)["records"]}

    plain, slow = run(), run(**cold)
    for rid in ("a", "b-t0"):
        assert slow[rid].ttft_s == pytest.approx(plain[rid].ttft_s + 0.014)
    assert slow["b-t1"].ttft_s == pytest.approx(plain["b-t1"].ttft_s, abs=5e-4)
