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


def wait_for(predicate: Callable[[], T], timeout_s: float = 10.0, what: str = "condition",
             interval_s: float = 0.1) -> T:
    """The first truthy value of `predicate()`, polled every `interval_s`; AssertionError naming
    `what` once `timeout_s` passed without one."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g}s")
        time.sleep(interval_s)
