"""What every test tier shares: the one FULL switch and the one way to wait for a condition.

FULL (BRIGADE_CHAOS_FULL=1, or BRIGADE_FULL=1) runs the long versions of the tests that have
them (the chaos suite's full counts, its figures written to benchmarks/results/chaos.json);
CI runs the reduced ones.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
FULL = os.environ.get("BRIGADE_CHAOS_FULL") == "1" or os.environ.get("BRIGADE_FULL") == "1"


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str | Callable[[], str] = "condition",
             interval_s: float = 0.1, *, raise_on_timeout: bool = True) -> T:
    """The first truthy value of `predicate()`, polled every `interval_s`.

    Once `timeout_s` passed without one: AssertionError naming `what` (a string, or a function
    called then, so the message can show the state that was never reached) and the last value;
    with `raise_on_timeout=False` the last (falsy) value instead, for callers that report it.
    Async tests wait with `await asyncio.to_thread(wait_for, ...)` and a blocking predicate.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            if not raise_on_timeout:
                return value
            said = what() if callable(what) else what
            raise AssertionError(f"{said} not reached within {timeout_s:g}s (last: {value!r})")
        time.sleep(interval_s)
