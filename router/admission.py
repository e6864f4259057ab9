"""Admission: at most RouterConfig.max_running requests dispatched at once; beyond, requests
wait, and beyond max_waiting requests (or max_waiting_tokens prompt tokens) waiting, a new
one is refused at once with Overloaded (429 / RESOURCE_EXHAUSTED) instead of queueing
unbounded memory."""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

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
    async def slot(self, prompt_tokens: int) -> AsyncIterator[float]:
        """Hold a running slot for one request; yields the seconds it waited for it."""
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
        try:
            yield time.monotonic() - arrived
        finally:
            self.running -= 1
            self._slots.release()

    def _note_peak(self) -> None:
        for name in self.peak:
            self.peak[name] = max(self.peak[name], getattr(self, name))

    def status(self) -> dict:
        return {"waiting": self.waiting, "running": self.running, "waiting_tokens": self.waiting_tokens,
                "peak": dict(self.peak)}
