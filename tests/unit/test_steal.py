"""The hypervisor's steal share (cluster/steal.py) and the benchmarks' retry on it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import _sim_validate  # noqa: E402

from cluster import steal  # noqa: E402


class Counters:
    """Our own interface's fake: the machine's (busy, stolen) CPU seconds, moved by hand."""

    def __init__(self) -> None:
        self.busy, self.stolen = 100.0, 5.0

    def __call__(self) -> tuple[float, float]:
        return self.busy, self.stolen


def test_the_share_is_of_the_cpu_time_wanted_since_the_meter_was_made(monkeypatch) -> None:
    counters = Counters()
    monkeypatch.setattr(steal, "cpu_times_s", counters)
    meter = steal.StealMeter()
    assert meter.share() == 0.0  # nothing wanted yet
    counters.busy += 3.0
    counters.stolen += 1.0
    assert meter.share() == pytest.approx(0.25)


def test_this_machine_reports_its_counters() -> None:
    busy, stolen = steal.cpu_times_s()
    assert busy > 0 and stolen >= 0
    assert 0.0 <= steal.StealMeter().share() <= 1.0


def test_a_stolen_measurement_is_taken_again_and_the_least_stolen_kept(monkeypatch) -> None:
    counters = Counters()
    monkeypatch.setattr(steal, "cpu_times_s", counters)
    monkeypatch.setattr(_sim_validate, "StealMeter", steal.StealMeter)
    stolen_per_try = iter([0.5, 0.2, 0.3])

    def measure() -> int:
        share = next(stolen_per_try)
        counters.busy += 1 - share
        counters.stolen += share
        return round(share * 10)

    assert _sim_validate.least_stolen(measure, "test") == (2, pytest.approx(0.2))  # all 3 over STOLEN
    quiet = iter([0.5, 0.01, 0.3])
    tries = []

    def measure_until_quiet() -> float:
        share = next(quiet)
        tries.append(share)
        counters.busy += 1 - share
        counters.stolen += share
        return share

    result, share = _sim_validate.least_stolen(measure_until_quiet, "test")
    assert tries == [0.5, 0.01] and result == 0.01 and share == pytest.approx(0.01)
