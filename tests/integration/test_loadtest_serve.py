"""`brigade bench` against a real `brigade serve` (local Ray, router, one prefill and one decode
worker, embedded redis-server) over its OpenAI-compatible HTTP API. Kept small: the tiny preset,
a handful of requests, one server for the module."""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import brigade_serve

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]
SERVE = [sys.executable, "-m", "cluster.cli", "serve", "--http-port", "0", "--num-blocks", "256"]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp_path_factory.mktemp("serve") / "serve.log") as served:
        yield served.http_base


def bench(url: str, out: Path, *flags: str) -> dict:
    assert cli.main(["bench", "run", "--url", url, "--no-progress", "--output-dir", str(out), "--ignore-eos",
                     "--return-token-ids", *flags]) == 0
    return json.loads((out / "result.json").read_text())


def test_shared_prefix_against_brigade_serve(base_url: str, tmp_path: Path) -> None:
    result = bench(base_url, tmp_path, "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2",
                   "--system-prompt-len", "48", "--question-len", "8", "--output-len", "4", "--max-concurrency", "1",
                   "--slo", "ttft=60s")
    run, = result["runs"]
    assert (run["completed"], run["failed"]) == (4, 0), run["errors_by_kind"]
    for rec in run["records"]:
        assert rec["prompt_tokens"] == 56 and rec["output_tokens"] == 4  # the server's usage
        assert sum(rec["chunk_tokens"]) == 4 and rec["ttft_s"] <= rec["e2e_s"]
    # Brigade reports cached prompt tokens: each group's second question reuses its system prompt's blocks.
    by_id = {r["session_id"]: r for r in run["records"]}
    assert by_id["group0-q0"]["cached_tokens"] == 0 and by_id["group1-q0"]["cached_tokens"] == 0
    assert by_id["group0-q1"]["cached_tokens"] >= 32 and by_id["group1-q1"]["cached_tokens"] >= 32
    assert run["cache_hit_ratio"] > 0 and run["request_goodput"] == pytest.approx(run["request_throughput"])
    # What the workers' steps took during the run, from /metrics before and after it: one at a
    # time, each request's prompt is one step on the prefill worker, and its 3 tokens after the
    # first are 3 decode steps alone on the decode worker.
    steps = run["server_steps"]
    prompt = {w: sum(t["steps"] for t in kinds.get("prompt", {}).values()) for w, kinds in steps.items()}
    decode = {w: kinds.get("decode", {}) for w, kinds in steps.items()}
    assert sorted(prompt.values()) == [0, 4] and sorted(sum(t["steps"] for t in d.values())
                                                          for d in decode.values()) == [0, 12]
    assert all(set(d) <= {"1"} for d in decode.values())
    assert all(0 < t["cpu_s"] and 0 < t["wall_s"] for kinds in steps.values() for k in kinds.values()
               for t in k.values())


def test_multi_turn_and_text_prompts_against_brigade_serve(base_url: str, tmp_path: Path) -> None:
    result = bench(base_url, tmp_path / "ids", "--workload", "multi-turn", "--num-sessions", "2", "--num-turns", "2",
                   "--input-len", "6", "--output-len", "3", "--think-time", "0")
    run, = result["runs"]
    assert run["completed"] == 4 and run["failed"] == 0
    turns = sorted(run["records"], key=lambda r: (r["session_id"], r["turn"]))
    assert [r["prompt_tokens"] for r in turns] == [6, 15, 6, 15]  # q1 + a1 (3 ids) + q2
    text = bench(base_url, tmp_path / "text", "--workload", "random", "--num-prompts", "3", "--input-len", "5",
                 "--output-len", "2", "--prompt-format", "text")
    assert text["runs"][0]["completed"] == 3 and text["runs"][0]["total_output_tokens"] == 6


def test_sim_calibrate_measures_the_serving_path_of_brigade_serve(base_url: str) -> None:
    """`brigade sim calibrate --url` then `--disagg-url`'s measurement (cluster/serving_costs.py)
    against the real serve, kept short: every term it sets comes back measured, each within
    what it was measured from, and the disaggregated pass leaves the colocated terms alone."""
    from cluster.serving_costs import COLD_IDLE_S, measure_serving, step_timer
    from engine.presets import PRESETS
    from sim.corun import SPANS_S
    from sim.hardware import DeviceProfile
    from sim.shapes import ModelShape

    shape = ModelShape.from_config("tiny", PRESETS["tiny"].config)
    engine_fit = DeviceProfile(name="this-machine", peak_flops=20e9, mem_bw=20e9, mem_bytes=8e9,
                               step_overhead_s=0.001, dtype_bytes=4, host_cores=2.0)
    short = {"requests": 3, "long_len": 68, "decode_tokens": 12, "streams": 2, "rounds": 1, "stream_rounds": 1,
             "cold_rounds": 1, "oversubscribed_rounds": 1}
    # As `brigade sim calibrate` measures: against the engine's own steps timed in this process at
    # the same moment. Without it the prompts' steps were the profile's, with the serving terms
    # just measured from one short streaming round added; on a loaded CI run those came out above
    # the short prompt's whole TTFT and both request terms were clamped to 0.
    timer = step_timer("tiny", "float32", threads=1)
    colocated, seen = measure_serving(base_url, engine_fit, shape, timer=timer, **short)
    # The line through the short and the long prompt's medians: its intercept is clamped at 0
    # when a busy moment lifts the long one (once on a loaded 2-core CI run, 3 requests each), so
    # what is certain is the short prompt's whole cost, above 0 and (the intercept) within its TTFT.
    assert colocated.request_overhead_s + 4 * colocated.request_overhead_per_token_s > 0
    assert 0 <= colocated.request_overhead_s <= seen["median_ttft_4_s"]
    assert colocated.request_overhead_per_token_s >= 0 and colocated.stream_cpu_s >= 0
    assert colocated.token_overhead_s >= 0 and colocated.worker_step_overhead_s >= 0
    assert seen["time_per_token_1_streams_s"] > 0 and seen["time_per_token_2_streams_s"] > 0
    assert seen["idle_cpu_rate"] >= -0.05  # the machine's busy time less the workers': never below 0 but a tick
    # the workers' own CPU per streamed token beyond their steps (one torch thread: the served step log
    # holds a step's whole CPU), measured from the step counters and counted in the streaming's CPU
    assert seen["worker_stream_cpu_s"] is not None
    assert colocated.stream_cpu_s == pytest.approx(
        max(0.0, seen["outside_stream_cpu_s"] + max(0.0, seen["worker_stream_cpu_s"])))
    # what the serve keeps busy idle, beside the workers and per worker, in the profile's core slots
    slots = engine_fit.host_cores / len(os.sched_getaffinity(0))
    assert colocated.background_cores == pytest.approx(max(0.0, seen["idle_cpu_rate"]) * slots)
    # a served decode step's CPU with an engine stepping beside it in another process, and alone
    assert seen["served_decode_step_cpu_alone_s"] > 0 and seen["served_decode_step_cpu_beside_s"] > 0
    assert colocated.oversubscribed_slowdown == pytest.approx(
        max(1.0, seen["served_decode_step_cpu_beside_s"] / seen["served_decode_step_cpu_alone_s"]))
    assert seen["idle_workers"] >= 1 and seen["worker_idle_cpu_rate"] >= 0
    assert colocated.worker_background_cores == pytest.approx(
        seen["worker_idle_cpu_rate"] / seen["idle_workers"] * slots)
    assert colocated.host_cores == 2.0 and colocated.decode_token_overhead_s is None
    # What idle costs a step and a request, at each idle timed (the extras >= 0 by the profile's own check)
    assert [i for i, _ in colocated.cold_step_s] == [i for i, _ in colocated.cold_request_s] == list(COLD_IDLE_S)
    assert seen["ttft_after_idle_s"][0.0] > 0 and seen["decode_step_after_idle_s"][0.0] > 0

    # the co-run scene simulated at one phase, not three: the fit's grid is most of this test's time
    disagg, seen = measure_serving(base_url, colocated, shape, disaggregated=True, timer=timer, corun_phases=1,
                                   **short)
    assert seen["decode_step_1_s"] > 0 and seen["second_token_gap_1_stream_s"] > 0
    assert 0 <= disagg.decode_admit_overhead_s < seen["second_token_gap_1_stream_s"]
    assert disagg.decode_token_overhead_s is not None and disagg.decode_token_overhead_s >= 0
    assert disagg.decode_worker_step_overhead_s is not None and disagg.handoff_overhead_s >= 0
    assert seen["handoff_from_cold_s"] >= 0 and seen["simulated_alone_at_that_short_s"] > 0  # set again from them
    assert 1.0 <= disagg.corun_slowdown <= 4.0
    assert disagg.kv_receive_cpu_per_token_s >= 0  # the decode worker's CPU per KV token it takes in
    assert seen["decode_cpu_per_request_68_s"] > 0 and seen["decode_cpu_per_request_4_s"] > 0
    assert seen["hit_alone_s"] > 0 and seen["hit_beside_1_s"] > 0
    assert seen["long_hit_alone_s"] > 0 and seen["long_hit_beside_1_s"] > 0
    assert 0 <= disagg.corun_wait_s <= 0.1
    # the hits beside three answers too, and the wait per answer beyond the first fitted from them
    assert seen["hit_beside_3_s"] > 0 and seen["long_hit_beside_3_s"] > 0
    assert 0 <= disagg.corun_wait_per_answer_s <= 0.02
    # and cold prompts beside one answer, where the ceiling's span is fitted
    assert seen["cold_hit_alone_s"] > 0 and seen["cold_hit_beside_1_s"] > 0
    assert disagg.corun_span_s in SPANS_S and seen["measured_growth_cold_s"] is not None
    assert seen["jitter_long_s"] and disagg.request_jitter_s  # the short hits' spread is the profile's
    # the answer streamed through the scene: its pace before the hits and beside them, and the fit's;
    # the tiny model may finish its 1,000 tokens before the first hit, and then the fit says so
    if "decode_fit_skipped" in seen:
        assert "ended before" in seen["decode_fit_skipped"] and disagg.decode_corun_slowdown == 1.0
    else:
        assert seen["measured_answer_gap_quiet_s"] > 0 and seen["measured_answer_gap_beside_s"] > 0
        assert 1.0 <= disagg.decode_corun_slowdown <= 4.0
    # the terms refined together on the whole scene, never further from it than the fits one by one
    assert seen["joint_miss_after"] <= seen["joint_miss_before"] and seen["joint_passes"] >= 1
    assert seen["joint_growth_short_s"] is not None and "joint_growth_3_short_s" in seen
    keep = ("request_overhead_s", "request_overhead_per_token_s", "token_overhead_s", "worker_step_overhead_s",
            "stream_cpu_s", "cold_step_s", "cold_request_s", "background_cores", "worker_background_cores",
            "oversubscribed_slowdown")
    assert {k: getattr(disagg, k) for k in keep} == {k: getattr(colocated, k) for k in keep}
