"""Admission: at most RouterConfig.max_running requests dispatched at once; beyond, requests
wait, and beyond max_waiting requests (or max_waiting_tokens prompt tokens) waiting, a new
one is refused at once with Overloaded (429 / RESOURCE_EXHAUSTED) instead of queueing
unbounded memory."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

from router.config import RouterConfig
from router.errors import Overloaded


class Admission:
    def __init__(self, cfg: RouterConfig):
        self.cfg = cfg
        self.waiting = 0
        self.waiting_tokens = 0  # prompt tokens of the waiting requests
        self.running = 0
        self.peak = {"waiting": 0, "waiting_tokens": 0, "running": 0}  # high-water marks since start
        self._slots = asyncio.Semaphore(cfg.max_running)

    @contextlib.asynccontextmanager
    async def slot(self, prompt_tokens: int) -> AsyncIterator[Slot]:
        """Hold a running slot for one request, until the block ends or Slot.release()."""
        if self._slots.locked() and (self.waiting >= self.cfg.max_waiting
                                     or self.waiting_tokens + prompt_tokens > self.cfg.max_waiting_tokens):
            raise Overloaded(f"overloaded: {self.waiting} requests ({self.waiting_tokens} prompt tokens) waiting; "
                             "retry later")
        arrived = time.monotonic()
        self.waiting += 1
        self.waiting_tokens += prompt_tokens
        self._note_peak()
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.waiting_tokens -= prompt_tokens
        self.running += 1
        self._note_peak()
        held = Slot(time.monotonic() - arrived, self._release)
        try:
            yield held
        finally:
            held.release()

    def _release(self) -> None:
        self.running -= 1
        self._slots.release()

    def _note_peak(self) -> None:
        for name in self.peak:
            self.peak[name] = max(self.peak[name], getattr(self, name))

    def status(self) -> dict:
        return {"waiting": self.waiting, "running": self.running, "waiting_tokens": self.waiting_tokens,
                "peak": dict(self.peak)}


class Slot:
    """One request's running slot; `waited_s`: how long it waited for it."""

    def __init__(self, waited_s: float, release: Callable[[], None]):
        self.waited_s, self._release = waited_s, release

    def release(self) -> None:
        """Give the slot back (once; again is a no-op)."""
        if self._release is not None:
            self._release, release = None, self._release
            release()
