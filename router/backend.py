"""What both front doors need from whatever runs the model (cluster/backend.py's
ClusterBackend in a cluster; fakes in the door tests).

Each door parses its own wire format, then builds the same GenerateRequest (tokenized with
`tokenize`/`chat_token_ids`, checked with `validate`: none of which touches an engine) and
calls the one async `generate`. The HTTP door's handler threads reach it through a loop of
their own (router/http/bridge.py).
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from engine.messages import Chunk, GenerateRequest
from engine.sampling import SamplingParams


class Backend(Protocol):
    model_name: str  # the id the doors list and requests may name
    max_model_len: int
    vocab_size: int

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """Token ids for a prompt; InvalidRequest (field "prompt") if it cannot be tokenized."""

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for token ids; InvalidRequest (field "token_ids") for ids outside the vocabulary."""

    def chat_token_ids(self, messages: list[dict], **template) -> list[int]:
        """Messages through the chat template, with `tools`, `documents` and `template_kwargs`
        (chat_template_kwargs) when the request has them; InvalidRequest naming the field if
        malformed ("messages" when the template refuses them)."""

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """InvalidRequest naming the field if the request can never run."""

    def output_room(self, token_ids: list[int]) -> int:
        """The most tokens an answer to this prompt can have: the rest of the context, within
        the smallest worker's KV pool. A chat request that names no max_tokens gets it."""

    def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """The request's chunks, the last one `finished`. Admission errors (Overloaded,
        NoWorker, InvalidRequest) come from the first chunk. Leaving early (aclose(), or the
        task cancelled) aborts the request and frees its KV. Prefixes are shared in the KV
        caches only between requests with the same `cache_salt`."""

    async def health(self) -> tuple[bool, dict]:
        """(can serve now, details for /health; "waiting"/"running" at the router if known)."""

    async def worker_stats(self) -> dict[str, dict]:
        """Each worker's engine counters by worker id (LLMEngine.stats(): blocks, queues,
        "step_times"), for /metrics; {} where there are no workers to ask."""
