"""Any OpenAI-compatible server over HTTP (Brigade, vLLM, SGLang, ...): streamed
/v1/completions or /v1/chat/completions, server-sent events parsed as they arrive.

Only standard fields are sent unless the config asks for extensions (ignore_eos,
return_token_ids, extra_body), so a strict server accepts every request.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator

import httpx

from loadtest import server_steps
from loadtest.targets import TargetConfig
from loadtest.types import Content, Prompt, StreamChunk, TargetError, Usage
from loadtest.workloads.tokens import as_text


def flatten(contents: list[Content]) -> Content:
    """One completions prompt from a history: token ids concatenated, or text joined."""
    if all(isinstance(c, list) for c in contents):
        return [t for c in contents for t in c]
    return "\n".join(c if isinstance(c, str) else as_text(c) for c in contents)


class OpenAIHttpTarget:
    def __init__(self, cfg: TargetConfig):
        self.cfg = cfg
        key = os.environ.get(cfg.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # No pool limit: the runner decides concurrency; a pool cap would queue requests unseen.
        self.client = httpx.AsyncClient(base_url=cfg.resolved_url, headers=headers,
                                        timeout=httpx.Timeout(cfg.timeout_s, connect=30.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        self.path = "/v1/chat/completions" if cfg.endpoint == "chat" else "/v1/completions"

    def body(self, prompt: Prompt) -> dict:
        cfg = self.cfg
        body: dict = {"max_tokens": prompt.max_tokens, "temperature": cfg.temperature, "stream": True,
                      "stream_options": {"include_usage": True}}
        if cfg.endpoint == "chat":
            body["messages"] = [{"role": m.role, "content": m.content if isinstance(m.content, str)
                                 else as_text(m.content)} for m in prompt.messages]
        else:
            body["prompt"] = flatten([m.content for m in prompt.messages])
        if cfg.model:
            body["model"] = cfg.model
        if cfg.ignore_eos:
            body["ignore_eos"] = True
        if cfg.return_token_ids:
            body["return_token_ids"] = True
        return {**body, **cfg.extra_body}

    async def stream(self, prompt: Prompt) -> AsyncIterator[StreamChunk]:
        try:
            async with self.client.stream("POST", self.path, json=self.body(prompt)) as resp:
                if resp.status_code != 200:
                    detail = (await resp.aread()).decode(errors="replace")
                    raise TargetError(f"http_{resp.status_code}", _error_message(detail))
                finished = False
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        finished = True
                        break
                    now = time.perf_counter()
                    chunk, done = self._chunk(payload, now)
                    finished |= done
                    if chunk is not None:
                        yield chunk
                if not finished:
                    raise TargetError("incomplete", "the stream ended before a finish_reason or [DONE]")
        except httpx.TimeoutException as exc:
            raise TargetError("timeout", f"no answer within {self.cfg.timeout_s} s ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise TargetError("connection", f"{type(exc).__name__}: {exc}") from None

    def _chunk(self, payload: str, now: float) -> tuple[StreamChunk | None, bool]:
        try:
            event = json.loads(payload)
        except ValueError:
            raise TargetError("bad_response", f"an SSE event is not JSON: {payload[:80]!r}") from None
        if "error" in event:
            raise TargetError("stream_error", _error_message(json.dumps(event)))
        usage = _usage(event.get("usage"))
        choices = event.get("choices") or []
        if not choices:
            return (StreamChunk(now, 0, usage=usage) if usage else None), False
        choice = choices[0]
        if choice.get("finish_reason") == "abort":  # vLLM's and Brigade's: the server gave the request up
            raise TargetError("aborted", "the server aborted the request (finish_reason 'abort')")
        delta = choice.get("delta") or {}
        text = (delta.get("content") if self.cfg.endpoint == "chat" else choice.get("text")) or ""
        ids = choice.get("token_ids")
        n = len(ids) if isinstance(ids, list) else int(bool(text))
        return StreamChunk(now, n, text=text, token_ids=ids if isinstance(ids, list) else None,
                           usage=usage), choice.get("finish_reason") is not None

    async def server_steps(self) -> dict | None:
        try:
            resp = await self.client.get("/metrics", timeout=10.0)
        except httpx.HTTPError:
            return None
        if resp.status_code != 200:
            return None
        try:
            return server_steps.parse(resp.text)
        except ValueError:  # not Prometheus text: a server with another /metrics
            return None

    async def aclose(self) -> None:
        await self.client.aclose()


def _usage(raw) -> Usage | None:
    if not isinstance(raw, dict):
        return None
    details = raw.get("prompt_tokens_details") or {}
    return Usage(int(raw.get("prompt_tokens") or 0), int(raw.get("completion_tokens") or 0),
                 int(details.get("cached_tokens") or 0))


def _error_message(detail: str) -> str:
    try:
        err = json.loads(detail).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err)[:300]
    except (ValueError, AttributeError):
        return detail[:300]
