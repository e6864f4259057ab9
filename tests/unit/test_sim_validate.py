"""sim_bench's validation harness (benchmarks/_sim_validate.py, _sim_measured.py): the twin of
a measured fleet replays exactly bench's requests on this machine's model (shared cores, a
serving path), the error is in units of the measured run-to-run spread, and stored tries are
re-simulated, not measured again."""
from __future__ import annotations

import asyncio

import pytest

from benchmarks import _sim_measured as M
from benchmarks import _sim_validate as V
from sim.clock import run_virtual
from sim.cost import Roofline, StepWork
from sim.hardware import load_device
from sim.metrics import SimRecord
from sim.shapes import load_shape

DEVICE = load_device("cpu-2core").model_dump()
SERVING = {"request_overhead_s": 0.008, "request_overhead_per_token_s": 1e-5, "handoff_overhead_s": 0.003,
           "decode_admit_overhead_s": 0.01, "token_overhead_s": 0.001, "decode_token_overhead_s": 0.002,
           "stream_cpu_s": 0.0}
SMALL = V.Load(rates=(2.0,), num_groups=2, prompts_per_group=2, system_prompt_len=64, question_len=8, output_len=4)


def _ends(cores: float, jobs: list[float], stream_cpu_s: float = 0.0, decode: int = 0) -> list[float]:
    async def main() -> list[float]:
        host, loop = V.SharedCores(cores, stream_cpu_s), asyncio.get_running_loop()
        t0, ends = loop.time(), []

        async def one(s: float) -> None:
            await host.step(s, prompt=False, decode=decode)
            ends.append(loop.time() - t0)

        await asyncio.gather(*(one(s) for s in jobs))
        return sorted(ends)

    return run_virtual(main())


def test_shared_cores_run_each_step_at_its_share() -> None:
    """Two steps on two cores take their own time; on one core they share it (the shorter ends
    when both have run half its length at half speed, the longer runs alone after)."""
    assert _ends(2, [0.1, 0.3]) == pytest.approx([0.1, 0.3])
    assert _ends(1, [0.1, 0.3]) == pytest.approx([0.2, 0.4])
    assert _ends(1, [0.1]) == pytest.approx([0.1])


def test_streamed_tokens_leave_work_that_shares_the_cores() -> None:
    """Each step's sampled tokens leave stream_cpu_s apiece behind it: a step that starts while
    that work runs on the only core shares the core with it."""
    async def main() -> float:
        host, loop = V.SharedCores(1, stream_cpu_s=0.05), asyncio.get_running_loop()
        await host.step(0.1, prompt=False, decode=2)  # leaves 0.1 s of streaming work
        t0 = loop.time()
        await host.step(0.1, prompt=False, decode=0)
        return loop.time() - t0

    assert run_virtual(main()) == pytest.approx(0.2)  # 0.1 of its own and 0.1 of the streaming's, shared


def test_the_serving_path_lands_on_every_token_and_the_admission_after_the_first() -> None:
    rec = SimRecord("r", "r", 0, start_s=0.0, prompt_tokens=100, output_tokens=3, ttft_s=0.05, e2e_s=0.09,
                    chunk_times_s=[0.05, 0.07, 0.09], chunk_tokens=[1, 1, 1])
    run = {"records": [rec], "duration": 0.09}
    way = 0.008 + 100 * 1e-5
    colocated = V.with_serving_path(run, SERVING, False, None)
    (c,) = colocated["records"]
    assert c.chunk_times_s == pytest.approx([0.05 + way, 0.07 + way, 0.09 + way]) and c.ttft_s == c.chunk_times_s[0]
    assert c.e2e_s == pytest.approx(0.09 + way) and colocated["mean_tpot_ms"] == pytest.approx(20.0)
    (d,) = V.with_serving_path(run, SERVING, True, None)["records"]
    assert d.ttft_s == pytest.approx(0.05 + way + 0.003)
    assert d.chunk_times_s[1:] == pytest.approx([0.07 + way + 0.013, 0.09 + way + 0.013])
    assert rec.chunk_times_s == [0.05, 0.07, 0.09]  # the simulated run is left as it was


def test_a_served_device_adds_the_workers_own_costs_per_step_and_sequence() -> None:
    served = V.served_device(DEVICE, SERVING, disaggregated=False)
    assert served["seq_overhead_s"] == pytest.approx(DEVICE["seq_overhead_s"] + 0.001)
    assert V.served_device(DEVICE, SERVING, True)["seq_overhead_s"] == pytest.approx(DEVICE["seq_overhead_s"] + 0.002)
    assert served["step_overhead_s"] == DEVICE["step_overhead_s"]


def test_the_error_is_counted_in_measured_run_to_run_spreads() -> None:
    measured = [{"p50_ttft_ms": v, "cache_hit_ratio": 0.5} for v in (40.0, 44.0, 48.0)]  # mean 44, sd 4
    simulated = [{"p50_ttft_ms": v, "cache_hit_ratio": 0.5} for v in (50.0, 54.0)]  # mean 52
    errors = V.spread_errors(measured, simulated)
    p50 = errors["ttft_p50"]
    assert p50["spreads"] == pytest.approx(2.0) and p50["relative"] == pytest.approx(8 / 44)
    assert (p50["measured_min"], p50["measured_max"], p50["in_range"]) == (40.0, 48.0, False)
    # a figure that does not vary between tries is held to MIN_SPREAD of its mean
    hits = V.spread_errors(measured, [{"cache_hit_ratio": 0.51}])["hit_ratio"]
    assert hits["measured_stdev"] == 0 and hits["spreads"] == pytest.approx(2.0)
    assert errors["tpot_mean"] is None  # not measured: no error, not a zero


def test_the_twin_replays_bench_s_requests_for_each_rate_and_try() -> None:
    """bench draws the i-th rate's prompts from seed + i; a try's from the load's seed + its offset."""
    load = V.Load(rates=(1.0, 2.0), num_groups=2, prompts_per_group=2, system_prompt_len=16, question_len=4,
                  output_len=2)
    first, second = load.sessions(0), load.sessions(1)
    again, later = load.sessions(0), load.sessions(0, seed_offset=1000)
    assert [s.turns for s in first] == [s.turns for s in again]
    assert [s.arrival_s for s in first] == [s.arrival_s for s in again]
    assert [s.turns for s in first] != [s.turns for s in second] != [s.turns for s in later]


def test_stored_tries_are_resimulated_and_a_perfect_twin_is_zero_spreads_off() -> None:
    """validate() measures nothing: each stored try is simulated again from its own device,
    serving terms and prompts; tries that measured what their twin gives are 0 spreads off."""
    fleet = V.fleet_named("1p1d")
    tries = []
    for k, offset in enumerate((0, 1000, 2000)):
        device = {**DEVICE, "peak_flops": DEVICE["peak_flops"] * (1 + 0.1 * k)}  # the machine moved between tries
        sim = V.simulate_twin(fleet, "tiny", 256, device, SERVING, 2.0, SMALL.sessions(0, offset), None)
        tries.append({"seed_offset": offset, "device": device, "serving": SERVING, "measured": V.figures(sim)})
    stored = {"model": "tiny", "num_blocks": 256, "host_cores": 2.0,
              "loads": {"small": {**vars(SMALL), "rates": list(SMALL.rates)}},
              "points": [{"fleet": "1p1d", "load": "small", "rate": 2.0, "rate_index": 0, "tries": tries}]}
    ratios, rows = M.validate(stored)
    assert rows[0]["tries"] == 3 and set(ratios) == {f"sim_spread_{k}" for k in V.METRICS}
    assert all(v == pytest.approx(0.0, abs=1e-9) for v in ratios.values())
    stored["points"][0]["tries"][0]["measured"]["p50_ttft_ms"] *= 1.5  # one try measured slower
    assert M.validate(stored)[0]["sim_spread_ttft_p50"] > 0.5


def test_two_fits_are_averaged_in_time_per_unit() -> None:
    fast = {**DEVICE, "peak_flops": 2e11, "mem_bw": 4e10, "attn_eff": 0.5, "prompt_attn_eff": 1.0,
            "decode_attn_eff": 0.1, "step_overhead_s": 0.01, "seq_overhead_s": 0.001}
    slow = {**fast, "peak_flops": 1e11, "mem_bw": 2e10, "step_overhead_s": 0.02}
    mean = V.mean_fit(fast, slow)
    assert mean["peak_flops"] == pytest.approx(1 / ((1 / 2e11 + 1 / 1e11) / 2))
    assert mean["attn_eff"] == pytest.approx(0.5) and mean["step_overhead_s"] == pytest.approx(0.015)
    shape = load_shape("bench")
    step = StepWork.of([(512, 0, True)])
    r = [Roofline(shape, load_device("cpu-2core").model_validate(p)) for p in (fast, slow, mean)]
    assert r[2].step_s(step) == pytest.approx((r[0].step_s(step) + r[1].step_s(step)) / 2, rel=1e-6)
    assert V.engine_drift("bench", fast, fast) == 0 and V.engine_drift("bench", fast, slow) > 0.4


def test_fleet_names() -> None:
    assert V.fleet_named("2mixed").sim_fields() == {"mode": "colocated", "prefill": 2, "decode": 0}
    assert V.fleet_named("2p1d").serve_flags()[:5] == ["--mode", "disaggregated", "--prefill", "2", "--decode"]
    with pytest.raises(ValueError, match="not a fleet name"):
        V.fleet_named("3x")
