"""The serving path's CPU as `brigade sim calibrate --url` counts it: the machine's, exited
processes' included, less the workers'."""
from __future__ import annotations

import subprocess
import sys

from cluster.serve_cpu import CpuSample, cpu_sample, serving_cpu_s

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\n"


def test_a_process_that_exits_between_the_samples_still_counts() -> None:
    """Summed over the processes alive at each sample, a helper that came and went took its CPU
    with it (an idle second once measured -0.71 cores that way)."""
    before = cpu_sample()
    subprocess.run([sys.executable, "-c", BURN], check=True)
    assert serving_cpu_s(before, cpu_sample()) >= 0.35


def test_the_workers_own_cpu_is_left_out() -> None:
    since = CpuSample(busy_s=100.0, procs_s={11: 5.0, 12: 1.0, 20: 2.0}, workers=frozenset({11, 12}))
    until = CpuSample(busy_s=103.0, procs_s={11: 6.5, 12: 1.5, 13: 0.25, 20: 2.5},
                      workers=frozenset({11, 12, 13}))  # 13 started in between
    assert serving_cpu_s(since, until) == 3.0 - 1.5 - 0.5 - 0.25


def test_a_worker_titled_between_the_samples_is_charged_from_the_first() -> None:
    """Ray titles a pre-started worker only when an actor lands on it; the seconds it spent
    importing before the first sample are not the window's (-8 s once, under xdist)."""
    since = CpuSample(busy_s=100.0, procs_s={30: 8.0}, workers=frozenset())
    until = CpuSample(busy_s=101.0, procs_s={30: 8.5}, workers=frozenset({30}))
    assert serving_cpu_s(since, until) == 0.5
