"""How many long texts the front doors tokenize at once: at most `running` (each keeps a core busy,
with the GIL released), beyond that up to `waiting` more wait for a slot, and
beyond those a new one is refused at once with Overloaded (429 / RESOURCE_EXHAUSTED with a
retry hint), the same rule as the router's own admission (router/admission.py). Both doors share
one TokenizeSlots: they tokenize on their own threads (an HTTP handler thread, a gRPC worker
thread), which block here while they wait.
"""
from __future__ import annotations

import threading

from router.errors import Overloaded


class TokenizeSlots:
    def __init__(self, running: int, waiting: int):
        self.running, self.waiting = running, waiting
        self._slots = threading.Semaphore(running)
        self._lock = threading.Lock()
        self._queued = 0  # threads waiting for a slot now

    def __enter__(self) -> TokenizeSlots:
        if not self._slots.acquire(blocking=False):
            with self._lock:
                if self._queued >= self.waiting:
                    raise Overloaded(f"overloaded: {self.running} long prompts are being tokenized and "
                                     f"{self._queued} more wait; retry later")
                self._queued += 1
            try:
                self._slots.acquire()
            finally:
                with self._lock:
                    self._queued -= 1
        return self

    def __exit__(self, *exc) -> None:
        self._slots.release()
