"""The typed values that flow through a load test: what a workload asks for, what a target
streams back, and what the runner records per request."""
from __future__ import annotations

from dataclasses import dataclass

# The per-request record lives with the trace rows, which sim/ reuses; its name stays importable here.
from loadtest.records import RequestRecord as RequestRecord

Content = list[int] | str  # a prompt part as token ids or as text


@dataclass(frozen=True)
class Turn:
    """One user message of a session and how many tokens to ask for in reply."""

    content: Content
    output_len: int


@dataclass(frozen=True)
class Session:
    """A conversation: turn k+1 is sent (think_time_s) after turn k's answer, and resends the
    whole history. Single-turn workloads are sessions of one turn."""

    id: str
    turns: tuple[Turn, ...]
    system: Content | None = None  # a shared system prompt (the prefix of every turn)
    arrival_s: float | None = None  # the trace's own start time; None: the arrival process decides
    think_time_s: float = 0.0


@dataclass(frozen=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: Content


@dataclass(frozen=True)
class Prompt:
    """One request as a target sends it: the history so far, ending with a user message."""

    request_id: str
    session_id: str
    messages: tuple[Message, ...]
    max_tokens: int

    @property
    def expected_input_len(self) -> int:
        """Prompt tokens when the prompt is token ids (exact); words when it is text (approximate)."""
        return sum(len(m.content) if isinstance(m.content, list) else len(m.content.split())
                   for m in self.messages)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens whose KV came from a cache, when the server says


@dataclass(frozen=True)
class StreamChunk:
    """What a target yields: new tokens (stamped when they arrived) and, on the last chunk, usage."""

    time: float  # time.perf_counter() when the chunk arrived
    num_tokens: int  # new tokens in this chunk (exact with token ids, else 1 per non-empty text)
    text: str = ""
    token_ids: list[int] | None = None  # when the server sends them
    usage: Usage | None = None


class TargetError(Exception):
    """A failed request; `kind` groups errors in the summary (e.g. "http_429", "timeout")."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind
