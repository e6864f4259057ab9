"""The virtual clock: simulated time passes without sleeping, in timer order, and a stalled
simulation says so instead of hanging."""
from __future__ import annotations

import asyncio
import time

import pytest

from sim.clock import Stalled, run_virtual


def test_an_hour_of_sleeps_costs_no_wall_time() -> None:
    order: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await asyncio.sleep(seconds)
        order.append((name, asyncio.get_running_loop().time()))

    async def main() -> float:
        await asyncio.gather(sleeper("late", 3600.0), sleeper("early", 0.25), sleeper("mid", 60.0))
        await asyncio.wait_for(asyncio.sleep(1.0), timeout=5.0)  # timeouts run on the same clock
        return asyncio.get_running_loop().time()

    wall = time.perf_counter()
    end = run_virtual(main())
    assert time.perf_counter() - wall < 5.0  # an hour of simulated sleeping, not a real one
    assert order == [("early", 0.25), ("mid", 60.0), ("late", 3600.0)]
    assert end == pytest.approx(3601.0)


def test_a_timeout_fires_at_its_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), timeout=30.0)
        return loop.time()

    assert run_virtual(main()) == pytest.approx(30.0)


def test_waiting_on_what_never_happens_is_reported() -> None:
    async def main() -> None:
        await asyncio.Event().wait()  # nothing will ever set it, and no timer is pending

    with pytest.raises(Stalled):
        run_virtual(main())
