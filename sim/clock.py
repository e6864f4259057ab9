"""A virtual clock for asyncio: the real router's coroutines run unchanged, and time only
moves when nothing is ready.

asyncio's loop asks its selector to wait until the next timer is due. Our selector does not
wait: it moves the loop's clock to that timer and returns at once, so `asyncio.sleep(3600)`
costs no wall time, and a run is deterministic for a seed (one thread, ordered timers).
Everything the simulation needs from time it takes from `loop.time()`.
"""
from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Stalled(RuntimeError):
    """Nothing is ready and no timer is set: a coroutine waits for something no simulated
    event will ever do (a simulator bug, never a slow fleet)."""


class _JumpingSelector(selectors.DefaultSelector):
    def __init__(self, loop: VirtualLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None):
        ready = super().select(0)  # the loop's own wake-up pipe, never a real wait
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise Stalled("the simulated fleet is idle with nothing scheduled")
        self._loop.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop whose time() is virtual seconds from 0, jumping to the next timer when idle."""

    def __init__(self) -> None:
        self._now = 0.0
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh VirtualLoop; cancels what it left running."""
    loop = VirtualLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
