"""The co-run terms refined together (sim/corun_joint.py): the decode ceiling fitted last moves
the hits the earlier fits had matched; the joint refinement finds the terms that made the whole
scene, and never leaves it further than where it began."""
from __future__ import annotations

import pytest

from sim.corun import HitTtfts, fit_decode_corun, hit_ttfts, stream_gaps
from sim.corun_joint import PACE_WEIGHT_S, SceneFit, refine_jointly
from tests.sim_helpers import CORUN_HOST as HOST
from tests.sim_helpers import CORUN_SCENE as SCENE

GRIDS = {"corun_wait_s": (0.0, 0.01, 0.02), "corun_slowdown": (1.0, 1.3, 1.6),
         "decode_corun_slowdown": (1.0, 2.0, 3.0)}
MADE = {"corun_wait_s": 0.01, "corun_slowdown": 1.3, "decode_corun_slowdown": 3.0}


def test_the_scenes_miss_weighs_every_figure_both_have() -> None:
    one = HitTtfts(0.010, 0.020)
    want = SceneFit(one, HitTtfts(0.020, 0.030), 1.10)
    assert SceneFit(one, HitTtfts(0.020, 0.030), 1.10).miss(want) == 0.0
    assert SceneFit(HitTtfts(0.012, 0.020)).miss(want) == pytest.approx(0.002 ** 2)  # nothing else to compare
    assert SceneFit(one, HitTtfts(0.020, 0.033), 1.11).miss(want) == pytest.approx(
        0.003 ** 2 + (PACE_WEIGHT_S * 0.01) ** 2)
    cold = SceneFit(HitTtfts(0.010, 0.020, 0.05), pace=1.1)
    assert cold.miss(SceneFit(HitTtfts(0.010, 0.020, 0.04))) == pytest.approx(0.01 ** 2)  # the cold hits count


def test_the_joint_refinement_finds_the_terms_that_made_the_scene() -> None:
    made = HOST.model_copy(update=MADE)
    alone, beside, wide = (hit_ttfts(made, SCENE, width=w) for w in (0, 1, 3))
    pace = stream_gaps(made, SCENE)
    # The ceiling on the decode steps grows the hits too: a profile right but for it is off on them.
    assert hit_ttfts(made.model_copy(update={"decode_corun_slowdown": 1.0}), SCENE) != beside
    start = HOST.model_copy(update={"corun_wait_s": 0.0, "corun_slowdown": 1.6, "decode_corun_slowdown": 1.0})
    refined, seen = refine_jointly(start, SCENE, alone, beside, 3, wide, pace, grids=GRIDS)
    assert {k: getattr(refined, k) for k in MADE} == MADE
    assert seen["joint_miss_after"] == pytest.approx(0.0, abs=1e-12)
    assert seen["joint_miss_before"] > 1e-6
    assert seen["joint_growth_short_s"] == pytest.approx(beside.short_s - alone.short_s)
    assert seen["joint_answer_slowdown"] == pytest.approx(pace.ratio)
    assert seen["joint_passes"] >= 2  # a pass that moved a term, and one that confirmed none moves


def test_the_refinement_never_leaves_the_scene_further_than_the_fits_one_by_one() -> None:
    # A scene the grid cannot make exactly: the refinement moves only where the whole miss falls.
    made = HOST.model_copy(update={"corun_wait_s": 0.015, "corun_slowdown": 1.45, "decode_corun_slowdown": 2.5})
    alone, beside = hit_ttfts(made, SCENE, width=0), hit_ttfts(made, SCENE)
    pace = stream_gaps(made, SCENE)
    one_by_one, _ = fit_decode_corun(HOST.model_copy(update={"corun_wait_s": 0.01, "corun_slowdown": 1.6}), SCENE,
                                     pace, slowdowns=GRIDS["decode_corun_slowdown"])
    refined, seen = refine_jointly(one_by_one, SCENE, alone, beside, pace=pace, grids=GRIDS)
    assert seen["joint_miss_after"] <= seen["joint_miss_before"]
    assert "joint_growth_3_short_s" not in seen  # no scene beside three answers was measured
    # without a measured pace the decode ceiling stays where the fits left it
    kept, _ = refine_jointly(one_by_one, SCENE, alone, beside, grids=GRIDS)
    assert kept.decode_corun_slowdown == one_by_one.decode_corun_slowdown
