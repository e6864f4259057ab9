"""CPU time this machine's hypervisor took from it (steal, /proc/stat). On a shared cloud VM
it comes in spells of minutes: in one, measured here, it took 25-65% of the CPU time the
machine's processes wanted, and a served prefix hit's TTFT doubled (66 to 131 ms). A timing
taken during such a spell describes the neighbours, not this machine, so calibrations and
the simulator's validation measure the share and take their measurements again when it is
more than STOLEN."""
from __future__ import annotations

import psutil

STOLEN = 0.05  # the share of wanted CPU time above which a measurement is not of this machine


def cpu_times_s() -> tuple[float, float]:
    """This machine's CPU seconds so far: busy (every process's, exited ones' too) and stolen."""
    t = psutil.cpu_times()
    busy = t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return busy, getattr(t, "steal", 0.0)  # no steal counter: not a VM (or not Linux)


class StealMeter:
    """The share of the CPU time this machine's processes wanted since it was made that the
    hypervisor gave to others."""

    def __init__(self) -> None:
        self._start = cpu_times_s()

    def share(self) -> float:
        busy, steal = (now - then for now, then in zip(cpu_times_s(), self._start))
        return steal / (busy + steal) if busy + steal > 0 else 0.0
