"""corun_wait_s and corun_slowdown are fitted by simulating the measured scene (sim/corun.py):
the fit finds the wait and the slowdown that made a scene's short and long hits slower, and
none where sharing the cores explains it all; the handoff is set from the scene's lone hits; the
decode slowdown is the one that slowed the scene's answer beside the hits."""
from __future__ import annotations

from dataclasses import replace

import pytest

from sim.corun import (
    HitScene,
    HitTtfts,
    StreamGaps,
    fit_corun,
    fit_corun_span,
    fit_decode_corun,
    fit_wait_per_answer,
    handoff_to_match,
    hit_ttfts,
    jitter_quantiles,
    stream_gaps,
)
from tests.sim_helpers import CORUN_HOST as HOST
from tests.sim_helpers import CORUN_SCENE as SCENE

GRID = {"slowdowns": (1.0, 1.3, 1.6, 2.0), "waits_s": (0.0, 0.01, 0.02, 0.03)}  # the default's is finer


def _with(wait_s: float, slowdown: float):
    return HOST.model_copy(update={"corun_wait_s": wait_s, "corun_slowdown": slowdown})


def test_the_fit_finds_the_wait_and_the_slowdown_that_made_the_scene() -> None:
    alone = hit_ttfts(HOST, SCENE, width=0)
    beside = hit_ttfts(_with(0.02, 1.6), SCENE)
    fair = hit_ttfts(HOST, SCENE)
    assert beside.short_s > fair.short_s > alone.short_s and beside.long_s > fair.long_s  # beyond the fair share
    assert alone.long_s > alone.short_s  # the long hits' step is longer
    fitted, seen = fit_corun(HOST, SCENE, alone, beside, **GRID)
    assert (fitted.corun_wait_s, fitted.corun_slowdown) == (0.02, 1.6)
    assert seen["simulated_growth_short_s"] == pytest.approx(beside.short_s - alone.short_s)
    assert seen["simulated_growth_long_s"] == pytest.approx(beside.long_s - alone.long_s)
    assert not seen["at_bound"]


def test_a_wait_grows_both_hits_alike_and_a_slowdown_the_long_one_more() -> None:
    fair = hit_ttfts(HOST, SCENE)
    waited, slowed = hit_ttfts(_with(0.03, 1.0), SCENE), hit_ttfts(_with(0.0, 2.0), SCENE)
    assert waited.short_s - fair.short_s == pytest.approx(waited.long_s - fair.long_s, abs=0.01)
    assert slowed.long_s - fair.long_s > 1.5 * (slowed.short_s - fair.short_s) > 0
    alone = hit_ttfts(HOST, SCENE, width=0)
    for made, wait_s, slowdown in ((waited, 0.03, 1.0), (slowed, 0.0, 2.0)):
        fitted, _ = fit_corun(HOST, SCENE, alone, made, **GRID)
        assert (fitted.corun_wait_s, fitted.corun_slowdown) == (wait_s, slowdown)


def test_growth_the_fair_share_explains_needs_neither() -> None:
    alone, fair = hit_ttfts(HOST, SCENE, width=0), hit_ttfts(HOST, SCENE)
    half = HitTtfts(*(a + 0.5 * (f - a) for a, f in zip(alone[:2], fair[:2])))
    fitted, seen = fit_corun(HOST, SCENE, alone, half, **GRID)
    assert fitted.corun_slowdown == 1.0 and fitted.corun_wait_s == 0.0
    assert seen["growth_at_none_short_s"] > seen["measured_growth_short_s"] > 0
    assert not seen["at_bound"]


def test_growth_beyond_the_model_stops_at_the_bound_and_says_so() -> None:
    alone = hit_ttfts(HOST, SCENE, width=0)
    beside = HitTtfts(alone.short_s + 10.0, alone.long_s + 30.0)
    fitted, seen = fit_corun(HOST, SCENE, alone, beside, **GRID)
    assert seen["at_bound"] and seen["simulated_growth_short_s"] < 10.0
    assert (fitted.corun_wait_s, fitted.corun_slowdown) == (0.03, 2.0)  # the grid's largest


def test_the_wait_per_answer_is_what_the_hits_beside_three_answers_took_beyond_the_wait_beside_one() -> None:
    fitted_one = _with(0.01, 1.3)
    alone = hit_ttfts(fitted_one, SCENE, width=0)
    made = hit_ttfts(fitted_one.model_copy(update={"corun_wait_per_answer_s": 0.006}), SCENE, width=3)
    shared = hit_ttfts(fitted_one, SCENE, width=3)  # the same wait beside any number of answers
    assert made.short_s > shared.short_s and made.long_s > shared.long_s
    fitted, seen = fit_wait_per_answer(fitted_one, SCENE, 3, alone, made)
    assert fitted.corun_wait_per_answer_s == pytest.approx(0.006)
    assert (fitted.corun_wait_s, fitted.corun_slowdown) == (0.01, 1.3)  # fit_corun's, kept
    assert seen["simulated_growth_3_short_s"] == pytest.approx(made.short_s - alone.short_s)
    assert seen["growth_3_at_no_extra_short_s"] == pytest.approx(shared.short_s - alone.short_s)
    assert not seen["wide_at_bound"]
    # what sharing the cores beside three answers explains needs none; more than the grid's largest says so
    assert fit_wait_per_answer(fitted_one, SCENE, 3, alone, shared)[0].corun_wait_per_answer_s == 0.0
    far = HitTtfts(made.short_s + 1.0, made.long_s + 1.0)
    assert fit_wait_per_answer(fitted_one, SCENE, 3, alone, far)[1]["wide_at_bound"]
    with pytest.raises(ValueError, match="2 or more"):
        fit_wait_per_answer(fitted_one, SCENE, 1, alone, made)


def test_the_span_is_where_the_cold_hits_stop_growing_with_their_step() -> None:
    # The calibration's scene (short, long and cold hits in turn), its hits far enough apart that
    # none waits for the last on this slow profile (a cold hit beside the answer takes 0.77 s).
    scene = HitScene("bench", width=1, spacing_s=0.8)
    fitted_one = _with(0.01, 1.6)
    alone = hit_ttfts(fitted_one, scene, width=0)
    assert alone.cold_s > alone.long_s > alone.short_s  # every cold hit computes its whole prompt
    made = hit_ttfts(fitted_one.model_copy(update={"corun_span_s": 0.1}), scene)
    whole = hit_ttfts(fitted_one, scene)
    assert whole.cold_s - made.cold_s > 0.01  # the ceiling spared the cold steps' tail
    assert made.short_s == pytest.approx(whole.short_s, abs=0.002)  # a short hit's step ends within it
    spans = (0.05, 0.1, 0.2, None)
    fitted, seen = fit_corun_span(fitted_one, scene, alone, made, spans_s=spans)
    assert fitted.corun_span_s == 0.1 and (fitted.corun_wait_s, fitted.corun_slowdown) == (0.01, 1.6)
    assert seen["simulated_growth_cold_s"] == pytest.approx(made.cold_s - alone.cold_s)
    assert seen["growth_cold_over_the_whole_step_s"] == pytest.approx(whole.cold_s - alone.cold_s)
    assert fit_corun_span(fitted_one, scene, alone, whole, spans_s=spans)[0].corun_span_s is None
    without = hit_ttfts(fitted_one, SCENE, width=0)
    assert without.cold_s is None
    with pytest.raises(ValueError, match="cold hits"):
        fit_corun_span(fitted_one, SCENE, without, hit_ttfts(fitted_one, SCENE), spans_s=spans)


def test_the_handoff_is_what_the_lone_hits_took_beyond_the_simulation() -> None:
    made = hit_ttfts(HOST.model_copy(update={"handoff_overhead_s": 0.012}), SCENE, width=0)
    handoff, sim = handoff_to_match(HOST, SCENE, made)
    assert handoff == pytest.approx(0.012, abs=0.001)
    assert sim == hit_ttfts(HOST, SCENE, width=0)
    # from a profile whose handoff was too long: it comes down, and never below zero
    assert handoff_to_match(HOST.model_copy(update={"handoff_overhead_s": 0.03}), SCENE, made)[0] == pytest.approx(
        0.012, abs=0.001)
    faster = HitTtfts(sim.short_s - 0.02, sim.long_s - 0.02)
    assert handoff_to_match(HOST, SCENE, faster)[0] == 0.0


def test_the_scene_is_simulated_at_spread_phases() -> None:
    one = hit_ttfts(HOST, replace(SCENE, phases=1), width=1)
    spread = hit_ttfts(HOST, SCENE)
    assert SCENE.phases > 1 and spread != one  # more samples, at other phases of the decode steps
    assert abs(spread.short_s - one.short_s) < SCENE.phase_window_s + 0.03  # the same scene, not another


def test_the_jitter_is_each_kinds_spread_about_its_own_median_pooled() -> None:
    short = [0.030, 0.031, 0.032, 0.035, 0.050]  # median 0.032
    long = [0.070, 0.068, 0.071]  # median 0.070
    q = jitter_quantiles(short, long, points=5)
    # pooled: -0.002, -0.002, -0.001, 0, 0, 0.001, 0.003, 0.018
    assert q[0] == pytest.approx(-0.002) and q[-1] == pytest.approx(0.018)
    assert q[2] == pytest.approx(0.0) and list(q) == sorted(q) and len(q) == 5
    assert jitter_quantiles([0.03]) == () and jitter_quantiles() == ()
    # A scene's simulation compares medians: it runs without the profile's jitter.
    jittery = HOST.model_copy(update={"request_jitter_s": (-0.005, 0.0, 0.05)})
    assert hit_ttfts(jittery, SCENE, width=0) == hit_ttfts(HOST, SCENE, width=0)


def test_stream_gaps_time_the_answer_before_the_first_hit_and_beside_the_hits() -> None:
    scene = HitScene("bench", width=1, quiet_from_s=0.3)
    # sent at 10 s; tokens every 10 ms until the first hit at 11.5 s, then every 15 ms
    times = [10.0 + 0.01 * i for i in range(151)] + [11.5 + 0.015 * i for i in range(1, 201)]
    gaps = StreamGaps.of(times, 10.0, 11.5, 14.5, scene)
    assert gaps.quiet_s == pytest.approx(0.01) and gaps.beside_s == pytest.approx(0.015)
    assert gaps.ratio == pytest.approx(1.5)
    with pytest.raises(ValueError, match="too few"):
        StreamGaps.of(times[:20], 10.0, 11.5, 14.5, scene)  # nothing after its admission


def test_the_decode_fit_finds_the_slowdown_that_slowed_the_answer() -> None:
    fair = stream_gaps(HOST, SCENE)
    made = stream_gaps(HOST.model_copy(update={"decode_corun_slowdown": 2.0}), SCENE)
    assert made.ratio > fair.ratio  # its steps beside the hits' prompt steps got less of a core
    assert made.quiet_s == pytest.approx(fair.quiet_s)  # before the first hit nothing else ran
    grid = (1.0, 1.5, 2.0, 3.0)
    fitted, seen = fit_decode_corun(HOST, SCENE, made, slowdowns=grid)
    assert fitted.decode_corun_slowdown == 2.0 and not seen["decode_at_bound"]
    assert seen["simulated_answer_slowdown"] == pytest.approx(made.ratio)
    assert seen["simulated_answer_slowdown_at_none"] == pytest.approx(fair.ratio)
    assert fit_decode_corun(HOST, SCENE, fair, slowdowns=grid)[0].decode_corun_slowdown == 1.0
    beyond = StreamGaps(made.quiet_s, 3 * made.beside_s)
    fitted, seen = fit_decode_corun(HOST, SCENE, beyond, slowdowns=grid)
    assert fitted.decode_corun_slowdown == 3.0 and seen["decode_at_bound"]
    with pytest.raises(ValueError, match="no answer"):
        stream_gaps(HOST, HitScene("bench", width=0))
    # An answer that ends before the hits has no pace beside them: the fit leaves the profile be.
    brief = HitScene("bench", width=1, stream_len=8)
    assert stream_gaps(HOST, brief) is None
    kept, seen = fit_decode_corun(HOST.model_copy(update={"decode_corun_slowdown": 1.5}), brief, made, slowdowns=grid)
    assert kept.decode_corun_slowdown == 1.5 and "ended before" in seen["decode_fit_skipped"]
