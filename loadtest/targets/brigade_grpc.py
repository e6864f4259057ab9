"""Brigade over gRPC, through the SDK's AsyncClient (brigade-client, in client/).

Chunks carry token ids, so token counts are exact and multi-turn token prompts resend the real
answer; the last chunk's usage includes the cached prompt tokens. The SDK's own retries are
off: a load test must see every UNAVAILABLE / RESOURCE_EXHAUSTED, not hide it.
"""
from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator

from loadtest.targets import TargetConfig
from loadtest.targets.openai_http import flatten
from loadtest.types import Prompt, StreamChunk, TargetError, Usage
from loadtest.workloads.tokens import as_text


class BrigadeGrpcTarget:
    def __init__(self, cfg: TargetConfig):
        try:
            from brigade_client import AsyncClient
        except ImportError:
            raise ValueError("--backend brigade-grpc needs the brigade-client SDK: pip install ./client "
                             "(or use --backend openai-http against `brigade serve --http-port`)") from None
        self.cfg = cfg
        self.client = AsyncClient(cfg.resolved_url, token=os.environ.get(cfg.api_key_env) or None,
                                  timeout=cfg.timeout_s, max_retries=0)

    async def stream(self, prompt: Prompt) -> AsyncIterator[StreamChunk]:
        from brigade_client import BrigadeError

        cfg = self.cfg
        if cfg.endpoint == "chat":
            request = {"messages": [{"role": m.role, "content": m.content if isinstance(m.content, str)
                                     else as_text(m.content)} for m in prompt.messages]}
        else:
            request = {"prompt": flatten([m.content for m in prompt.messages])}
        try:
            async for chunk in self.client.stream(
                    **request, max_tokens=prompt.max_tokens, temperature=cfg.temperature,
                    ignore_eos=cfg.ignore_eos or None, session_id=prompt.session_id, model=cfg.model or ""):
                if chunk.finish_reason == "abort":
                    raise TargetError("aborted", "the server aborted the request (finish_reason 'abort')")
                u = chunk.usage
                yield StreamChunk(time.perf_counter(), len(chunk.token_ids), chunk.text, list(chunk.token_ids),
                                  Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens) if u else None)
        except BrigadeError as exc:
            raise TargetError(f"grpc_{exc.code.name.lower()}", exc.message) from None

    async def server_steps(self) -> dict | None:
        return None  # the gRPC door serves no metrics; its HTTP door's /metrics has them

    async def aclose(self) -> None:
        await self.client.close()
