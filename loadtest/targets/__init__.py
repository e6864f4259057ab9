"""Targets: what the runner sends requests through. A target streams one request at a time
(many concurrently) as timestamped chunks; it knows the wire, never the workload."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from loadtest.types import Prompt, StreamChunk

Backend = Literal["openai-http", "brigade-grpc"]
DEFAULT_URLS = {"openai-http": "http://127.0.0.1:8000", "brigade-grpc": "127.0.0.1:50051"}


class TargetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = "openai-http"
    url: str | None = Field(None, description="server base URL (HTTP) or HOST:PORT (gRPC); default per backend")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="openai-http: /v1/completions or /v1/chat/completions")
    model: str | None = Field(None, description="the model name sent with each request (default: none sent)")
    api_key_env: str = Field("OPENAI_API_KEY", description="environment variable holding a bearer token")
    timeout_s: float = Field(600.0, gt=0, description="per request, from send to the last chunk")
    temperature: float = Field(0.0, ge=0)
    ignore_eos: bool = Field(False, description="ask for exactly max_tokens (vLLM/Brigade extension)")
    return_token_ids: bool = Field(False, description="ask for token ids per chunk (vLLM/Brigade extension)")
    extra_body: dict = Field(default_factory=dict, description="merged into every HTTP request body")

    @property
    def resolved_url(self) -> str:
        return (self.url or DEFAULT_URLS[self.backend]).rstrip("/")


class Target(Protocol):
    """One server. stream() may run many times concurrently; it raises TargetError on failure."""

    def stream(self, prompt: Prompt) -> AsyncIterator[StreamChunk]:
        """The answer's chunks as they arrive; the last carries usage when the server reports it."""

    async def server_steps(self) -> dict | None:
        """The server's engine step counters now (loadtest/server_steps.py), None where it has none."""

    async def aclose(self) -> None: ...


def make_target(cfg: TargetConfig) -> Target:
    if cfg.backend == "openai-http":
        from loadtest.targets.openai_http import OpenAIHttpTarget

        return OpenAIHttpTarget(cfg)
    from loadtest.targets.brigade_grpc import BrigadeGrpcTarget

    return BrigadeGrpcTarget(cfg)
