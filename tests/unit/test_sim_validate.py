"""sim_bench's measured-vs-simulated pieces (benchmarks/_sim_validate.py): the simulated twin
replays exactly the requests and arrival times `brigade bench` sends, and the errors are
relative to the measured run."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _sim_validate import (  # noqa: E402
    SERVING_TIMES,
    Fleet,
    Load,
    at_decode_speed,
    engine_drift,
    engine_fit_around,
    errors,
    fleet_config,
    simulate_load,
    step_speed,
    try_decode_speed,
)

from cluster.sim_bridge import from_loadtest  # noqa: E402
from loadtest.arrivals import arrival_offsets  # noqa: E402
from loadtest.config import BenchConfig  # noqa: E402
from loadtest.runner import _sessions  # noqa: E402

LOAD = Load(rates=(1.0, 4.0), num_groups=2, prompts_per_group=2, system_prompt_len=32, question_len=8, output_len=4,
            burstiness=0.5, seed=7)


def test_each_rate_replays_the_requests_and_arrivals_bench_sends_at_it() -> None:
    for i, rate in enumerate(LOAD.rates):
        cfg = BenchConfig(workload=LOAD.workload(0).model_copy(update={"seed": LOAD.seed}))
        sent = _sessions(cfg, LOAD.seed + i)  # what run_benchmark sends at the i-th rate
        offsets = arrival_offsets(sent, rate, "poisson", LOAD.burstiness, LOAD.seed + i)
        sim = from_loadtest(LOAD.workload(i), rate, burstiness=LOAD.burstiness)
        assert [s.arrival_s for s in sim] == offsets
        assert [[list(t[0]) for t in s.turns] for s in sim] == [[list(t.content) for t in s.turns] for s in sent]
        assert [list(s.system) for s in sim] == [list(s.system) for s in sent]


def test_the_twin_has_the_served_fleet_s_shape() -> None:
    mixed = Fleet("2mixed", "colocated", workers_colocated=2)
    assert mixed.serve_flags() == ["--mode", "colocated", "--decode", "2", "--num-cpus", "2"]
    cfg = fleet_config(mixed, "tiny", Path("cpu-2core"), 256)
    assert (cfg.mode, cfg.prefill, cfg.decode, cfg.num_blocks, cfg.link) == ("colocated", 2, 0, 256, "gloo-loopback")
    pd = Fleet("2p1d", "disaggregated", prefill=2, decode=1)
    assert pd.serve_flags()[-2:] == ["--num-cpus", "3"] and pd.workers == 3


def test_errors_are_relative_to_the_measured_run_and_none_where_unmeasured() -> None:
    measured = {"p50_ttft_ms": 100.0, "p90_ttft_ms": 200.0, "mean_tpot_ms": None, "request_throughput": 2.0,
                "cache_hit_ratio": 0.5}
    simulated = {"p50_ttft_ms": 110.0, "p90_ttft_ms": 150.0, "mean_tpot_ms": 9.0, "request_throughput": 2.0,
                 "cache_hit_ratio": 0.6}
    e = errors(measured, simulated)
    assert e["ttft_p50"] == pytest.approx(0.1) and e["ttft_p90"] == pytest.approx(0.25)
    assert e["tpot_mean"] is None and e["throughput"] == 0 and e["hit_ratio"] == pytest.approx(0.2)


def test_a_simulated_sweep_gives_one_run_per_rate() -> None:
    runs = simulate_load(Fleet("1p1d", "disaggregated", prefill=1, decode=1), LOAD, "tiny", Path("cpu-2core"), 256,
                         {"ttft": 1.0})
    assert [r["request_rate"] for r in runs] == [1.0, 4.0]
    assert all(r["completed"] == 4 and r["failed"] == 0 for r in runs)
    assert all(r["cache_hit_ratio"] > 0 for r in runs)  # the second question of each group finds its system prompt
    # the simulated workers' steps, as bench records a served run's: every request's prompt
    # computed in prompt steps, its 3 tokens after the first in decode steps on the decode worker
    for r in runs:
        decode = [t for kinds in r["server_steps"].values() for t in kinds.get("decode", {}).values()]
        assert sum(t["steps"] for t in decode) == 12
        assert all(t["wall_s"] >= t["cpu_s"] * (1 - 1e-9) and t["cpu_s"] > 0 for t in decode)
        assert sum(t["steps"] for kinds in r["server_steps"].values() for t in kinds.get("prompt", {}).values()) == 4


def test_micro_scenes_simulate_each_interaction(tmp_path: Path) -> None:
    """sim_micro's simulated side on a CPU host's profile: streams decoding beside a hit, and
    another hit's decode starting while it prefills, each make the hit slower, as on a real fleet."""
    from sim_micro import _simulate

    from sim.hardware import load_device

    host = load_device("cpu-2core").model_copy(update={"name": "host", "host_cores": 2.0, "stream_cpu_s": 0.005})
    profile = tmp_path / "host.json"
    profile.write_text(host.model_dump_json())
    scene = _simulate(profile, [0, 3], 2)
    assert set(scene) == {"hit_beside_0", "hit_beside_3", "tpot_beside_3", "hit_after_hit"}
    assert 0 < scene["tpot_beside_3"] < scene["hit_beside_3"]
    assert scene["hit_beside_3"] > scene["hit_beside_0"] > 0
    assert scene["hit_after_hit"] > scene["hit_beside_0"]


def test_engine_drift_is_the_largest_relative_move_of_a_validated_runs_steps() -> None:
    """Two engine fits around a measured run: the same machine gives 0; one whose steps all ran
    30% longer (every rate 1/1.3, every overhead x1.3) gives 0.3, whichever step is asked."""
    from sim.hardware import load_device

    fit = load_device("cpu-2core").model_copy(update={"seq_overhead_s": 0.002, "attn_eff": 0.5}).model_dump()
    slower = {**fit, "peak_flops": fit["peak_flops"] / 1.3, "mem_bw": fit["mem_bw"] / 1.3,
              "step_overhead_s": fit["step_overhead_s"] * 1.3, "seq_overhead_s": fit["seq_overhead_s"] * 1.3}
    assert engine_drift("bench", fit, fit) == 0
    assert engine_drift("bench", fit, slower) == pytest.approx(0.3)
    assert engine_drift("bench", slower, fit) == pytest.approx(1 - 1 / 1.3)  # relative to the first


def test_a_try_s_profile_scales_the_serving_terms_by_the_engine_s_move() -> None:
    """Fits around a try whose steps all ran 30% longer than the serving calibration's own
    engine fit: the engine terms are the fits' mean, and every serving time term is 1.3x (the
    same cores ran both); the co-run ceiling, a ratio, and the requests' spread, of waits, stay."""
    from sim.hardware import load_device

    serving = load_device("cpu-2core").model_copy(update={
        "seq_overhead_s": 0.002, "attn_eff": 0.5, "request_overhead_s": 0.008, "stream_cpu_s": 0.004,
        "handoff_overhead_s": 0.003, "decode_token_overhead_s": 0.002, "corun_wait_s": 0.01,
        "corun_wait_per_answer_s": 0.004, "corun_slowdown": 1.5, "request_jitter_s": (-0.002, 0.0, 0.005),
        "cold_step_s": ((0.5, 0.004),), "cold_request_s": ((0.5, 0.006), (2.0, 0.01))}).model_dump()
    slower = {**serving, "peak_flops": serving["peak_flops"] / 1.3, "mem_bw": serving["mem_bw"] / 1.3,
              "step_overhead_s": serving["step_overhead_s"] * 1.3, "seq_overhead_s": serving["seq_overhead_s"] * 1.3}
    out = engine_fit_around("bench", slower, slower, serving)
    assert out["peak_flops"] == pytest.approx(slower["peak_flops"])
    assert out["step_overhead_s"] == pytest.approx(slower["step_overhead_s"])
    for key in SERVING_TIMES:
        if serving.get(key) is not None:
            assert out[key] == pytest.approx(serving[key] * 1.3), key
    assert out["stream_cpu_s"] == pytest.approx(0.0052) and out["corun_slowdown"] == 1.5
    # The spread about a request's median is of waits, not of work on the cores: kept as measured.
    assert out["request_jitter_s"] == (-0.002, 0.0, 0.005)
    # What idle costs was timed against idle seconds in the calibration, not against its engine fit.
    assert out["cold_step_s"] == ((0.5, 0.004),) and out["cold_request_s"] == ((0.5, 0.006), (2.0, 0.01))
    same = engine_fit_around("bench", serving, serving, serving)
    kept = ("decode_batch_scale", "request_jitter_s", "cold_step_s", "cold_request_s")
    assert same.pop("decode_batch_scale") == [] and all(same.pop(k) == serving[k] for k in kept[1:])
    assert same == pytest.approx({k: v for k, v in serving.items() if k not in kept})
    # A decode batch's attention rate: the mean of the fits' per-flop times, as the others.
    fast, slow = ({**serving, "decode_attn_eff": e} for e in (0.2, 0.1))
    assert engine_fit_around("bench", fast, slow, serving)["decode_attn_eff"] == pytest.approx(1 / 7.5)
    # Decode batches' scales: the fits' means, where both have the batch.
    fast["decode_batch_scale"], slow["decode_batch_scale"] = [(1, 1.1), (2, 1.3)], [(1, 1.0), (2, 1.1), (4, 0.9)]
    scale = engine_fit_around("bench", fast, slow, serving)["decode_batch_scale"]
    assert [b for b, _ in scale] == [1, 2] and [s for _, s in scale] == pytest.approx([1.05, 1.2])


def test_a_fleets_tries_are_compared_by_each_figures_median() -> None:
    from _sim_measured import _median_figures

    tries = [{"p50_ttft_ms": 367.0, "mean_tpot_ms": 140.4, "completed": 32},
             {"p50_ttft_ms": 224.0, "mean_tpot_ms": 80.2, "completed": 32},
             {"p50_ttft_ms": 162.0, "mean_tpot_ms": 48.8, "completed": 31, "p90_ttft_ms": None}]
    median = _median_figures(tries)
    assert median["p50_ttft_ms"] == 224.0 and median["mean_tpot_ms"] == 80.2 and median["completed"] == 32
    assert median["p90_ttft_ms"] is None  # no try has it
    assert errors(median, {**median, "mean_tpot_ms": 88.22})["tpot_mean"] == pytest.approx(0.1)


def test_step_speed_tells_slow_steps_from_steps_that_waited() -> None:
    def steps(decode: dict, prompt_wall: float, prompt_cpu: float) -> dict:
        prompt = {"0": {"steps": 4, "wall_s": prompt_wall, "cpu_s": prompt_cpu}}
        return {"server_steps": {"decode-0": {"decode": decode}, "prefill-0": {"prompt": prompt}}}

    simulated = steps({"1": {"steps": 10, "wall_s": 0.2, "cpu_s": 0.2},
                       "4": {"steps": 10, "wall_s": 0.6, "cpu_s": 0.4}}, 1.0, 0.8)
    # served: batch 1 as simulated; batch 4 took 0.8 s of wall for 0.6 s of CPU; a batch the
    # simulation never ran is left out; the prompts ran 20% slow on the CPU itself
    measured = steps({"1": {"steps": 10, "wall_s": 0.2, "cpu_s": 0.2},
                      "4": {"steps": 10, "wall_s": 0.8, "cpu_s": 0.6},
                      "7": {"steps": 1, "wall_s": 9.0, "cpu_s": 9.0}}, 1.2, 0.96)
    speed = step_speed(measured, simulated)
    assert speed["decode"]["wall_vs_simulated"] == pytest.approx(1.0 / 0.8)
    assert speed["decode"]["cpu_vs_alone"] == pytest.approx(0.8 / 0.6)
    assert set(speed["decode"]["by_batch"]) == {"1", "4"}
    assert speed["decode"]["by_batch"]["4"]["served_ms"] == pytest.approx(80.0)
    assert speed["prompt"]["wall_vs_simulated"] == pytest.approx(1.2) and \
        speed["prompt"]["cpu_vs_alone"] == pytest.approx(1.2)
    assert step_speed({}, simulated) is None  # a server that does not count its steps


def test_simulated_steps_record_the_engine_alone_as_their_cpu_time(tmp_path: Path) -> None:
    """A served step's CPU time is its engine thread's: none of the worker's serving terms (its
    loop, each chunk's way out) are in it, so the simulated steps record the engine's step alone,
    and cpu_vs_alone compares like with like. The serving terms are in the wall time only."""
    from sim.hardware import load_device

    fleet = Fleet("1mixed", "colocated", workers_colocated=1)
    runs = {}
    for name, terms in (("bare", {}), ("served", {"worker_step_overhead_s": 0.002, "token_overhead_s": 0.005})):
        profile = tmp_path / f"{name}.json"
        profile.write_text(load_device("cpu-2core").model_copy(update=terms).model_dump_json())
        runs[name] = simulate_load(fleet, Load(rates=(1.0,), num_groups=1, prompts_per_group=1, system_prompt_len=32,
                                               question_len=8, output_len=6), "tiny", profile, 256, {})[0]
    decode = {name: r["server_steps"]["mixed-0"]["decode"]["1"] for name, r in runs.items()}
    assert decode["bare"]["steps"] == decode["served"]["steps"] == 5
    assert decode["served"]["cpu_s"] == pytest.approx(decode["bare"]["cpu_s"])
    assert decode["served"]["wall_s"] == pytest.approx(decode["bare"]["wall_s"] + 5 * (0.002 + 0.005))


def test_a_try_is_simulated_again_at_the_decode_speed_its_served_steps_ran_at(tmp_path: Path) -> None:
    """try_decode_speed: the median over a try's runs of its served decode steps' CPU over the
    simulated steps' alone; at_decode_speed: the profile with every decode step's engine part
    that many times as long, and nothing else changed."""
    from sim.cost import Roofline, StepWork
    from sim.hardware import DeviceProfile, load_device
    from sim.shapes import load_shape

    def run(decode_cpu_s: float) -> dict:
        return {"server_steps": {"decode-0": {"decode": {"1": {"steps": 10, "wall_s": 0.3, "cpu_s": decode_cpu_s}}}}}

    speeds = [step_speed(run(cpu_s), run(0.2)) for cpu_s in (0.22, 0.3, 0.24)]
    assert try_decode_speed(speeds) == pytest.approx(1.2)
    assert try_decode_speed([step_speed({}, run(0.2))] * 3) is None  # a server that counted no steps

    base = load_device("cpu-2core").model_copy(update={"token_overhead_s": 0.002,
                                                          "decode_batch_scale": ((1, 1.1), (4, 0.9))})
    for profile in (base, base.model_copy(update={"decode_batch_scale": ()})):
        path = tmp_path / "p.json"
        path.write_text(profile.model_dump_json())
        slower = DeviceProfile.model_validate_json(at_decode_speed(path, 1.2, tmp_path / "q.json").read_text())
        plain, r = Roofline(load_shape("bench"), profile), Roofline(load_shape("bench"), slower)
        decode = StepWork.of([(1, 300, True)] * 2)
        served = r.serving_s(decode)
        assert r.step_s(decode) - served == pytest.approx((plain.step_s(decode) - served) * 1.2)
        prompt = StepWork.of([(64, 0, True)])
        assert r.step_s(prompt) == pytest.approx(plain.step_s(prompt))
        assert slower.model_copy(update={"decode_batch_scale": profile.decode_batch_scale}) == profile
