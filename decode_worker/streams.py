"""Turning an engine's per-step outputs (delivered on its loop thread) into Chunks on asyncio."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.engine_loop import Sink
from engine.messages import Chunk
from engine.outputs import RequestOutput


class OutputStream:
    """A sink for EngineLoop that an asyncio task can iterate as Chunks."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue()
        self.finished = False
        self.aborted = False  # set by abort(), before the engine forgets the request

    @property
    def sink(self) -> Sink:
        return self._deliver

    def _deliver(self, out: RequestOutput | Chunk | BaseException) -> None:
        # Converted here, on the engine's thread: a RequestOutput shares its lists with the live
        # sequence (logprobs grow every step), so read later it would describe a later step.
        item = to_chunk(out) if isinstance(out, RequestOutput) else out
        self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def end_aborted(self, request_id: str, out: RequestOutput | None) -> None:
        """End an aborted request's stream (the engine's abort output reaches no sink): with
        that output, or an empty "abort" chunk when the engine no longer held it. Queued
        behind the outputs already delivered, like them."""
        self.sink(out or Chunk(request_id, [], "", True, "abort"))

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.finished:
            chunk = await self._queue.get()
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
