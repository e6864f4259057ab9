"""The SDK's typed results, converted from the protobuf messages."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SpeculativeUsage:
    """Speculative decoding's counters for one request: tokens proposed, of those accepted,
    verification steps, and the two ratios of them."""

    draft_tokens: int
    accepted_tokens: int
    verify_steps: int
    acceptance_rate: float
    accepted_per_step: float


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    speculative: SpeculativeUsage | None = None  # None when speculative decoding did not run


@dataclass(frozen=True)
class Timing:
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_bytes: int
    ttft_s: float
    total_s: float
    recomputed: bool


@dataclass(frozen=True)
class Chunk:
    """New tokens of a stream; the last one has `finished`, the reason, usage and timing."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finished: bool
    finish_reason: str | None = None
    usage: Usage | None = None
    timing: Timing | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None


@dataclass(frozen=True)
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob]
    finish_reason: str
    usage: Usage
    timing: Timing
    prefill_worker: str | None
    decode_worker: str | None


@dataclass(frozen=True)
class Model:
    id: str
    max_model_len: int
    vocab_size: int


def _logprobs(items) -> list[TokenLogprob]:
    return [TokenLogprob(p.token_id, p.logprob, [(t.token_id, t.logprob) for t in p.top]) for p in items]


def _usage(u) -> Usage:
    spec = None
    if u.HasField("speculative"):
        s = u.speculative
        spec = SpeculativeUsage(s.draft_tokens, s.accepted_tokens, s.verify_steps, s.acceptance_rate,
                                s.accepted_per_step)
    return Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens, dict(u.cached_by_tier), spec)


def _timing(t) -> Timing:
    return Timing(t.queue_s, t.prefill_s, t.transfer_s, t.transfer_bytes, t.ttft_s, t.total_s, t.recomputed)


def chunk_from_pb(c) -> Chunk:
    last = c.finished
    return Chunk(c.request_id, list(c.token_ids), c.text, _logprobs(c.logprobs), c.finished,
                 c.finish_reason if last else None, _usage(c.usage) if last else None,
                 _timing(c.timing) if last else None, (c.prefill_worker or None) if last else None,
                 (c.decode_worker or None) if last else None)


def completion_from_pb(r) -> Completion:
    return Completion(r.request_id, list(r.token_ids), r.text, _logprobs(r.logprobs), r.finish_reason,
                      _usage(r.usage), _timing(r.timing), r.prefill_worker or None, r.decode_worker or None)


def completion_from_chunks(chunks: list[Chunk]) -> Completion:
    last = chunks[-1]
    return Completion(last.request_id, [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks),
                      [p for c in chunks for p in c.logprobs], last.finish_reason, last.usage, last.timing,
                      last.prefill_worker, last.decode_worker)
