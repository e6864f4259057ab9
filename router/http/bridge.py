"""The HTTP door's handler threads calling the backend's async API: one event loop on a
thread of its own, and a blocking iterator over an async stream."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class LoopThread:
    def __init__(self, name: str = "http-backend"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop; blocks the calling (handler) thread until it is done."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, stream: AsyncIterator[T]) -> BlockingStream[T]:
        return BlockingStream(self, stream)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)


class BlockingStream(Generic[T]):
    """next() waits for the stream's next item; close() closes the stream on the loop (for a
    backend stream: aborting the request and freeing its KV), and returns once that is done."""

    def __init__(self, loop: LoopThread, stream: AsyncIterator[T]):
        self._loop, self._stream, self._done = loop, stream, False

    def __iter__(self) -> BlockingStream[T]:
        return self

    def __next__(self) -> T:
        try:
            return self._loop.run(_next(self._stream))
        except StopAsyncIteration:
            self._done = True
            raise StopIteration from None

    def close(self) -> None:
        if not self._done:
            self._done = True
            self._loop.run(self._stream.aclose())


async def _next(stream: AsyncIterator[T]) -> T:
    return await stream.__anext__()
