"""brigade.v1 protobuf messages to and from the router's typed messages (the gRPC edge only)."""
from __future__ import annotations

from brigade_client.v1 import brigade_pb2 as pb

from engine.messages import Chunk
from engine.sampling import InvalidRequest, SamplingParams, TokenLogprobs

# proto3 `optional` fields: copied only when present, so an unset field keeps the engine default.
_OPTIONAL = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos", "logprobs")


def sampling_params(msg: pb.SamplingParams) -> SamplingParams:
    """SamplingParams from the message; InvalidRequest naming the field (SamplingParams' own checks)."""
    fields = {name: getattr(msg, name) for name in _OPTIONAL if msg.HasField(name)}
    return SamplingParams(**fields, stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids))


def prompt(req: pb.GenerateRequest) -> tuple[str, object]:
    """("text", str) | ("token_ids", list[int]) | ("chat", list[dict]); InvalidRequest if none is set."""
    kind = req.WhichOneof("prompt")
    if kind == "text":
        return kind, req.text
    if kind == "token_ids":
        return kind, list(req.token_ids.ids)
    if kind == "chat":
        return kind, messages(req.chat)
    raise InvalidRequest("prompt", "set one of text, token_ids or chat")


def messages(chat: pb.ChatMessages) -> list[dict]:
    return [{"role": m.role, "content": m.content} for m in chat.messages]


def _logprobs(out, items: list[TokenLogprobs] | None) -> None:
    for lp in items or ():
        entry = out.add(token_id=lp.token_id, logprob=lp.logprob)
        for token_id, logprob in lp.top:
            entry.top.add(token_id=token_id, logprob=logprob)


def _last(out, chunk: Chunk) -> None:
    """The finish fields shared by GenerateChunk and GenerateResponse."""
    out.finish_reason = chunk.finish_reason or ""
    if chunk.usage is not None:
        u = chunk.usage
        out.usage.prompt_tokens, out.usage.completion_tokens = u.prompt_tokens, u.completion_tokens
        out.usage.cached_tokens = u.cached_tokens
        out.usage.cached_by_tier.update(u.cached_by_tier or {})
        if u.spec_draft_tokens:  # speculative decoding ran (as the HTTP usage's "speculative")
            s = out.usage.speculative
            s.draft_tokens, s.accepted_tokens = u.spec_draft_tokens, u.spec_accepted_tokens
            s.verify_steps = u.spec_steps
            s.acceptance_rate, s.accepted_per_step = u.spec_acceptance_rate, u.spec_accepted_per_step
    if chunk.timing is not None:
        t = chunk.timing
        out.timing.queue_s, out.timing.prefill_s, out.timing.transfer_s = t.queue_s, t.prefill_s, t.transfer_s
        out.timing.transfer_bytes, out.timing.recomputed = t.transfer_bytes, t.recomputed
        out.timing.ttft_s, out.timing.total_s = t.ttft_s, t.total_s
    out.prefill_worker = chunk.prefill_worker or ""
    out.decode_worker = chunk.decode_worker or ""


def chunk_message(chunk: Chunk, request_id: str, with_logprobs: bool) -> pb.GenerateChunk:
    out = pb.GenerateChunk(request_id=request_id, token_ids=chunk.token_ids, text=chunk.text,
                           finished=chunk.finished)
    if with_logprobs:
        _logprobs(out.logprobs, chunk.logprobs)
    if chunk.finished:
        _last(out, chunk)
    return out


def response_message(chunks: list[Chunk], request_id: str, with_logprobs: bool) -> pb.GenerateResponse:
    out = pb.GenerateResponse(request_id=request_id, token_ids=[t for c in chunks for t in c.token_ids],
                              text="".join(c.text for c in chunks))
    if with_logprobs:
        for c in chunks:
            _logprobs(out.logprobs, c.logprobs)
    _last(out, chunks[-1])
    return out
