"""Turning an engine's per-step outputs (delivered on its loop thread) into Chunks on asyncio."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from engine.engine_loop import Sink
from engine.outputs import RequestOutput
from router.types import Chunk


class OutputStream:
    """A sink for EngineLoop that an asyncio task can iterate as Chunks."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    @property
    def sink(self) -> Sink:
        return lambda out: self._loop.call_soon_threadsafe(self._queue.put_nowait, out)

    async def chunks(self) -> AsyncIterator[Chunk]:
        while not self.finished:
            out = await self._queue.get()
            if isinstance(out, BaseException):
                raise out
            self.finished = out.finished
            yield to_chunk(out)


def to_chunk(out: RequestOutput) -> Chunk:
    n = len(out.new_token_ids)
    return Chunk(
        request_id=out.request_id, token_ids=list(out.new_token_ids), text=out.new_text,
        finished=out.finished, finish_reason=out.finish_reason, usage=out.usage if out.finished else None,
        logprobs=out.logprobs[-n:] if out.logprobs and n else None,
    )
