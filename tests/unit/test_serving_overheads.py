"""A served decode step's cost beyond the engine's, split per step and per streamed token from
two measured widths, and what idle costs a step and a request (cluster/serving_costs.py)."""
from __future__ import annotations

import pytest

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
