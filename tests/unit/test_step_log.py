"""The engine's record of its steps (engine/step_log.py), how /metrics exposes it and how a load
test reads it back around a run (router/metrics.py, loadtest/server_steps.py)."""
from __future__ import annotations

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.step_log import StepLog, batch_label
from loadtest import server_steps
from router.metrics import FrontDoorMetrics


def test_batch_labels_are_exact_up_to_16_then_powers_of_two() -> None:
    assert [batch_label(n) for n in (0, 1, 16, 17, 32, 33, 100, 128, 129)] == \
        ["0", "1", "16", "32", "32", "64", "128", "128", "256"]


def test_the_log_tallies_steps_by_kind_and_batch() -> None:
    log = StepLog()
    log.record(False, 3, 0.03, 0.02)
    log.record(False, 3, 0.05, 0.04, steps=2)
    log.record(True, 0, 0.2, 0.19)
    log.record(True, 20, 0.3, 0.29)
    snap = log.snapshot()
    assert snap["decode"]["3"] == {"steps": 3, "wall_s": pytest.approx(0.08), "cpu_s": pytest.approx(0.06)}
    assert set(snap["prompt"]) == {"0", "32"}  # a prompt step beside 20 decodes: the 17-32 bucket


def test_the_engine_records_each_step_it_runs() -> None:
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64)))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("a", list(range(10, 30)), params)
    engine.step()  # a's prompt: a prompt step with nothing decoding
    engine.add_request("b", list(range(40, 60)), params)
    engine.step()  # b's prompt beside a's second token: a prompt step with one decoding
    while engine.has_runnable():
        engine.step()
    steps = engine.stats()["step_times"]
    assert steps["prompt"]["0"]["steps"] == 1 and steps["prompt"]["1"]["steps"] == 1
    # a: tokens 3 and 4 beside b's (batch 2); b: its 4th alone (batch 1)
    assert steps["decode"]["2"]["steps"] == 2 and steps["decode"]["1"]["steps"] == 1
    for tally in (t for kind in steps.values() for t in kind.values()):
        # one torch thread: the stepping thread's CPU is the step's, never more than its wall time
        assert 0 < tally["cpu_s"] <= tally["wall_s"] * 1.05 + 1e-3


def test_metrics_expose_the_workers_steps_and_a_load_test_reads_their_difference() -> None:
    metrics = FrontDoorMetrics()
    log = StepLog()
    log.record(False, 2, 0.04, 0.03)
    metrics.set_worker_stats({"decode-0": {"step_times": log.snapshot()}, "prefill-0": {"step_times": {}}})
    before = server_steps.parse(metrics.exposition().decode())
    assert before == {"decode-0": {"decode": {"2": {"steps": 1, "wall_s": 0.04, "cpu_s": 0.03}}}}
    log.record(False, 2, 0.06, 0.05)
    log.record(True, 0, 0.5, 0.4)
    metrics.set_worker_stats({"decode-0": {"step_times": log.snapshot()}})
    after = server_steps.parse(metrics.exposition().decode())
    diff = server_steps.between(before, after)
    assert diff["decode-0"]["decode"]["2"] == {"steps": 1, "wall_s": pytest.approx(0.06), "cpu_s": pytest.approx(0.05)}
    assert diff["decode-0"]["prompt"]["0"]["steps"] == 1
    means = server_steps.mean_step_ms(diff)
    assert means == {"2": {"steps": 1, "wall_ms": pytest.approx(60.0), "cpu_ms": pytest.approx(50.0)}}


def test_a_worker_that_does_not_answer_keeps_its_counters_and_one_gone_drops_them() -> None:
    metrics = FrontDoorMetrics()
    log = StepLog()
    log.record(False, 1, 0.01, 0.01)
    metrics.set_worker_stats({"a": {"step_times": log.snapshot()}, "b": {"step_times": log.snapshot()}})
    metrics.set_worker_stats({"a": {"error": "RayActorError()"}})  # b left the pool; a timed out
    assert set(server_steps.parse(metrics.exposition().decode())) == {"a"}


def test_a_server_without_step_series_gives_none_and_one_before_any_step_nothing() -> None:
    assert server_steps.parse('brigade_requests_total{door="http",outcome="ok"} 1.0\n') is None
    assert server_steps.parse(FrontDoorMetrics().exposition().decode()) == {}
