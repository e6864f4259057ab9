"""The sweep that makes transfer holds leases: a worker's stale holds are freed on a timer,
not only when the next request arrives, so a worker that gets no more traffic (the router
died between reserve and prefill, or between prefill and pull) still gives its KV back."""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class LeaseSweeper:
    """Calls `sweep` every `interval_s` on a daemon thread until stop()."""

    def __init__(self, sweep: Callable[[], object], interval_s: float, name: str):
        self._sweep = sweep
        self._interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @staticmethod
    def interval_for(hold_timeout_s: float) -> float:
        """Often enough that a hold outlives its timeout by at most a quarter of it (or 1 s)."""
        return min(1.0, hold_timeout_s / 4)

    def _run(self) -> None:
        while not self._stopped.wait(self._interval_s):
            try:
                self._sweep()
            except Exception:  # a failed sweep is retried at the next tick; the worker goes on
                log.exception("lease sweep failed")

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
