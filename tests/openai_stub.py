"""A minimal OpenAI-compatible server for load-test tests: stdlib asyncio, SSE streaming, nothing
from Brigade, so a test against it shows `brigade bench` needs only the public protocol.

It streams `max_tokens` one-token chunks ("w{i} ", ids when asked) and reports usage with
cached_tokens from its own toy prefix cache: the longest run of whole BLOCK-token blocks the
prompt shares with an earlier prompt (token-id prompts only). Every `fail_every`-th request
is answered 503; `misbehave` maps a request's number (1-based) to a broken stream: "error" (an
error event after one token), "abort" (finish_reason "abort"), "cut" (the connection closes after
one token), "empty" (every chunk's text is empty, as for tokens ending inside a UTF-8 character:
only usage and token ids count them). `bodies` keeps every request body, in arrival order;
any GET (bench asks for `/metrics`) is answered 404.
"""
from __future__ import annotations

import asyncio
import json
import threading

BLOCK = 16


class OpenAIStub:
    def __init__(self, token_delay_s: float = 0.001, fail_every: int = 0, misbehave: dict[int, str] | None = None):
        self.token_delay_s, self.fail_every, self.misbehave = token_delay_s, fail_every, misbehave or {}
        self.bodies: list[dict] = []
        self.paths: list[str] = []
        self.gets: list[str] = []  # GETs (brigade bench asks for /metrics around each run), answered 404
        self.blocks: set[tuple[int, ...]] = set()  # every cached block-aligned prefix
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.port = 0

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        assert self._ready.wait(10), "stub server did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            self._ready.set()
            async with server:
                await self._stop.wait()

        self._loop.run_until_complete(main())
        self._loop.close()

    def _cached(self, prompt) -> int:
        if not isinstance(prompt, list):
            return 0
        full = len(prompt) // BLOCK
        hit = 0
        for n in range(1, full + 1):
            if tuple(prompt[:n * BLOCK]) not in self.blocks:
                break
            hit = n * BLOCK
        self.blocks.update(tuple(prompt[:n * BLOCK]) for n in range(1, full + 1))
        return hit

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = (await reader.readline()).decode()
            headers = {}
            while (line := (await reader.readline()).decode().strip()):
                key, _, value = line.partition(":")
                headers[key.lower()] = value.strip()
            body = json.loads(await reader.readexactly(int(headers.get("content-length", 0))) or b"{}")
            method, path = request_line.split()[:2]
            if method != "POST":  # no /metrics, nothing else to GET: as a minimal server, 404
                self.gets.append(path)
                return await self._send(writer, 404, {"error": {"message": f"no route {path}", "type": "not_found"}})
            self.bodies.append(body)
            self.paths.append(path)
            if self.fail_every and len(self.bodies) % self.fail_every == 0:
                return await self._send(writer, 503, {"error": {"message": "stub overloaded", "type": "server_error"}})
            chat = path == "/v1/chat/completions"
            prompt = body["messages"] if chat else body["prompt"]
            n_prompt = len(prompt) if isinstance(prompt, list) and not chat else len(json.dumps(prompt).split())
            cached = 0 if chat else self._cached(prompt)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n")
            n = body["max_tokens"]
            broken = self.misbehave.get(len(self.bodies))
            for i in range(n):
                await asyncio.sleep(self.token_delay_s)
                if broken in ("error", "abort", "cut") and i == 1:
                    if broken == "error":
                        await self._event(writer, {"error": {"message": "worker died", "type": "server_error"}})
                    if broken == "abort":
                        await self._event(writer, {"id": "x", "choices": [
                            {"index": 0, "text": "", "finish_reason": "abort"}]})
                    return
                done = "length" if i == n - 1 else None
                text = "" if broken == "empty" else f"w{i} "
                choice = ({"index": 0, "delta": {"content": text}, "finish_reason": done} if chat
                          else {"index": 0, "text": text, "finish_reason": done})
                if body.get("return_token_ids"):
                    choice["token_ids"] = [100 + i]
                await self._event(writer, {"id": "x", "choices": [choice]})
            if (body.get("stream_options") or {}).get("include_usage"):
                await self._event(writer, {"id": "x", "choices": [], "usage": {
                    "prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n,
                    "prompt_tokens_details": {"cached_tokens": cached}}})
            writer.write(b"data: [DONE]\n\n")
            await writer.drain()
        finally:
            writer.close()

    async def _event(self, writer: asyncio.StreamWriter, payload: dict) -> None:
        writer.write(b"data: " + json.dumps(payload).encode() + b"\n\n")
        await writer.drain()

    async def _send(self, writer: asyncio.StreamWriter, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} Error\r\nContent-Type: application/json\r\nContent-Length: {len(data)}"
                     f"\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
