"""corun_slowdown is fitted by simulating the measured scene (sim/corun.py): the fit finds
the slowdown that made a scene's hits slower, and 1 where sharing the cores explains it all."""
from __future__ import annotations

import pytest

from sim.corun import HitScene, fit_corun_slowdown, hit_ttft_s
from sim.hardware import load_device

HOST = load_device("cpu-2core").model_copy(update={"name": "host", "host_cores": 2.0, "stream_cpu_s": 0.002})
SCENE = HitScene("bench", width=2, hits=4)  # the streams outlast the hits (as measured)


def test_the_fit_finds_the_slowdown_that_made_the_scene() -> None:
    alone = hit_ttft_s(HOST, SCENE, width=0)
    beside = hit_ttft_s(HOST.model_copy(update={"corun_slowdown": 1.8}), SCENE)
    assert beside > hit_ttft_s(HOST, SCENE) > alone  # it slows the hits beyond the fair share
    slowdown, seen = fit_corun_slowdown(HOST, SCENE, alone, beside)
    assert slowdown == pytest.approx(1.8, abs=0.05)
    assert seen["simulated_growth_s"] == pytest.approx(beside - alone, rel=0.05)
    assert not seen["at_bound"]


def test_growth_the_fair_share_explains_needs_no_slowdown() -> None:
    alone = hit_ttft_s(HOST, SCENE, width=0)
    fair = hit_ttft_s(HOST, SCENE) - alone  # what sharing the cores alone adds
    slowdown, seen = fit_corun_slowdown(HOST, SCENE, alone, alone + 0.5 * fair)
    assert slowdown == 1.0 and seen["growth_at_1_s"] > seen["measured_growth_s"] > 0
    assert not seen["at_bound"]


def test_growth_beyond_the_model_stops_at_the_bound_and_says_so() -> None:
    alone = hit_ttft_s(HOST, SCENE, width=0)
    slowdown, seen = fit_corun_slowdown(HOST, SCENE, alone, alone + 10.0, most=3.0)
    assert slowdown == 3.0 and seen["at_bound"] and seen["simulated_growth_s"] < 10.0
