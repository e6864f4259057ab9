"""A served decode step's cost beyond the engine's, split per step and per streamed token from
two measured widths, the workers' own CPU per streamed token beyond their steps, and what idle
costs a step and a request (cluster/serving_costs.py)."""
from __future__ import annotations

import pytest

from cluster.serve_cpu import StreamRun, worker_stream_cpu_s
from cluster.serving_costs import _step_and_token_overheads, cold_tables


def test_the_line_through_one_and_many_streams() -> None:
    per_step, per_seq = _step_and_token_overheads(0.005, 0.011, 4)  # 3 + 2 ms, 3 + 4 * 2 ms
    assert per_step == pytest.approx(0.003) and per_seq == pytest.approx(0.002)


def test_one_stream_faster_than_the_engine_is_fitted_with_no_per_step_cost_not_clamped() -> None:
    """-1.3 ms and 13.3 ms (a Zen3 calibration): the line's per-step cost is -6.2 ms; clamped
    to 0 it would leave 4.9 ms a token, one stream predicted 6 ms slow; the least-squares fit
    through the origin splits the miss between the two."""
    per_step, per_seq = _step_and_token_overheads(-0.0013, 0.0133, 4)
    assert per_step == 0.0
    assert per_seq == pytest.approx((-0.0013 + 4 * 0.0133) / 17)
    assert abs(per_seq - -0.0013) < 0.0049 and abs(4 * per_seq - 0.0133) < 0.0049


def test_many_streams_cheaper_than_one_leave_a_per_step_cost_only() -> None:
    per_step, per_seq = _step_and_token_overheads(0.006, 0.004, 4)
    assert (per_step, per_seq) == (pytest.approx(0.005), 0.0)
    assert _step_and_token_overheads(-0.002, -0.004, 4) == (0.0, 0.0)


def test_what_idle_costs_a_request_is_its_growth_beyond_its_steps() -> None:
    """Times after 0 (right after the last), 0.4 and 2 s idle: the step's growth is the engine's
    table; the request's growth less the step's the serving path's, at least 0."""
    engine = {0.0: 0.0143, 0.4: 0.0191, 2.0: 0.0244}
    served = {0.0: 0.0290, 0.4: 0.0420, 2.0: 0.0380}
    step, request = cold_tables(engine, served)
    assert [i for i, _ in step] == [i for i, _ in request] == [0.4, 2.0]
    assert [e for _, e in step] == pytest.approx([0.0048, 0.0101])
    assert [e for _, e in request] == pytest.approx([0.0082, 0.0])


def _run(tokens: int, steps: int, worker_cpu_s: float | None, wall_s: float = 1.0) -> StreamRun:
    return StreamRun(0.02, 0.02, 0.1, wall_s, tokens, 1, worker_cpu_s, steps)


def test_the_workers_own_cpu_per_token_is_beyond_their_steps_idle_and_step_overheads() -> None:
    """Two rounds: 48 tokens in 48 steps and 192 in 48 (four answers at once), the workers'
    processes 0.30 and 0.80 s of CPU beyond their steps' in 1 s each; idling they spend 0.01 s a
    second, and the simulator charges each step 0.5 ms and each token 1 ms beyond the engine's."""
    runs = [_run(48, 48, 0.30), _run(192, 48, 0.80)]
    charged = 0.0005 * 96 + 0.001 * 240
    assert worker_stream_cpu_s(runs, 0.01, 0.0005, 0.001) == pytest.approx((1.10 - 0.02 - charged) / 240)
    # more idle polling or more charged to the steps leave less to the streaming
    assert worker_stream_cpu_s(runs, 0.05, 0.0005, 0.001) < worker_stream_cpu_s(runs, 0.01, 0.0005, 0.001)
    assert worker_stream_cpu_s(runs, 0.01, 0.0005, 0.002) < worker_stream_cpu_s(runs, 0.01, 0.0005, 0.001)


def test_no_worker_cpu_without_the_servers_step_counts() -> None:
    """A server that counts no steps (vLLM's) leaves the steps' CPU unknown: nothing is guessed."""
    assert worker_stream_cpu_s([_run(48, 48, 0.3), _run(48, 0, None)], 0.0, 0.0, 0.0) is None
    assert worker_stream_cpu_s([], 0.0, 0.0, 0.0) is None
