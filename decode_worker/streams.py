"""Turning an engine's per-step outputs (delivered on its loop thread) into Chunks on asyncio,
holding the request in the engine while its reader is behind."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

from engine.engine_loop import Sink
from engine.messages import STREAM_WINDOW_CHUNKS, Chunk
from engine.outputs import RequestOutput

# Unread chunks at which the engine stops decoding the request, and at which it resumes. Each
# hop after this one (Ray, the router, the door) holds at most STREAM_WINDOW_CHUNKS, so a
# reader that stops costs a few windows of chunks and its KV, whatever its max_tokens.
HOLD_AT = STREAM_WINDOW_CHUNKS
RESUME_AT = STREAM_WINDOW_CHUNKS // 4


class OutputStream:
    """A sink for EngineLoop that an asyncio task can iterate as Chunks. With `hold` it is
    backpressure too: hold(True) once HOLD_AT chunks wait unread, hold(False) when the reader
    is down to RESUME_AT (the worker passes LLMEngine.hold through EngineLoop.call)."""

    def __init__(self, hold: Callable[[bool], object] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self._hold = hold
        # The count and the flag change on both threads; hold() is called under the lock so
        # a pause and the resume after it reach the engine in that order.
        self._lock = threading.Lock()
        self._unread = 0
        self.held = False
        self.finished = False
        self.aborted = False  # set by abort(), before the engine forgets the request

    @property
    def sink(self) -> Sink:
        return self._deliver

    def _deliver(self, out: RequestOutput | Chunk | BaseException) -> None:
        # Converted here, on the engine's thread: a RequestOutput shares its lists with the live
        # sequence (logprobs grow every step), so read later it would describe a later step.
        item = to_chunk(out) if isinstance(out, RequestOutput) else out
        with self._lock:
            self._unread += 1
            if self._hold is not None and not self.held and self._unread >= HOLD_AT:
                self.held = True
                self._hold(True)
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def end_aborted(self, request_id: str, out: RequestOutput | None) -> None:
        """End an aborted request's stream (the engine's abort output reaches no sink): with
        that output, or an empty "abort" chunk when the engine no longer held it. Queued
        behind the outputs already delivered, like them."""
        self.sink(out or Chunk(request_id, [], "", True, "abort"))

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.finished:
            chunk = await self._queue.get()
            with self._lock:
                self._unread -= 1
                if self.held and self._unread <= RESUME_AT:
                    self.held = False
                    self._hold(False)
            if isinstance(chunk, BaseException):
                raise chunk
            self.finished = chunk.finished
            yield chunk


def to_chunk(out: RequestOutput) -> Chunk:
    n = len(out.new_token_ids)
    return Chunk(
        request_id=out.request_id, token_ids=list(out.new_token_ids), text=out.new_text,
        finished=out.finished, finish_reason=out.finish_reason, usage=out.usage if out.finished else None,
        logprobs=out.logprobs[-n:] if out.logprobs and n else None,
    )
