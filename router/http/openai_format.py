"""OpenAI request bodies in, OpenAI response bodies out: the HTTP door's translation layer.

Parsing turns a `/v1/completions` or `/v1/chat/completions` body into token ids and
SamplingParams (raising InvalidRequest naming the field, before any work is queued); a string
anywhere in the body that is not UTF-8-encodable text (a lone surrogate) is refused first.
Shaping turns the backend's Chunks into `text_completion` / `chat.completion` objects and
their streaming `.chunk` forms, with logprobs in each endpoint's own format.

Fields clients commonly send and we do not act on (`user`, `frequency_penalty` at 0, ...)
are ignored; fields whose meaning we would silently change (n > 1, best_of > 1, echo) are
refused.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.outputs import Usage
from engine.sampling import InvalidRequest, SamplingParams, TokenLogprobs
from router.errors import ModelNotFound
from router.request_fields import SAMPLING_FIELDS, sampling_params, token_ids
from router.request_text import check_body_text


@dataclass
class ParsedRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last event with usage and no choices
    return_token_ids: bool  # an extension (as in vLLM): the tokens, not only text
    cache_salt: str | None  # the request's own salt (vLLM's field); the door prefixes the tenant


UNSUPPORTED = ("frequency_penalty", "presence_penalty", "logit_bias", "tools", "functions", "response_format")


def _plain_text_format(name: str, value: Any) -> bool:
    return name == "response_format" and value == {"type": "text"}


def _common(body: dict, backend) -> dict[str, Any]:
    check_body_text(body)  # first: every field read below, and the backend, see UTF-8-encodable text only
    if body.get("model") not in (None, backend.model_name):
        raise ModelNotFound(body["model"], backend.model_name)
    for name in ("n", "best_of"):
        if body.get(name) not in (None, 1):
            raise InvalidRequest(name, f"only {name}=1 is supported, got {body[name]!r}")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("stream_options", "must be an object like {\"include_usage\": true}")
    for name in UNSUPPORTED:  # refused rather than ignored: the answer would not be what was asked
        if body.get(name) not in (None, 0, [], {}) and not _plain_text_format(name, body[name]):
            raise InvalidRequest(name, f"{name} is not supported here")
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise InvalidRequest("cache_salt", f"must be a non-empty string, got {salt!r:.40}")
    return {"stream": stream, "include_usage": bool((options or {}).get("include_usage")),
            "return_token_ids": _flag(body, "return_token_ids"), "cache_salt": salt}


def parse_completion(body: dict, backend) -> ParsedRequest:
    common = _common(body, backend)
    if _flag(body, "echo"):
        raise InvalidRequest("echo", "echo is not supported")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if not isinstance(prompt, str):
        prompt = token_ids(prompt, "prompt")
    params = sampling_params(body, SamplingParams(), SAMPLING_FIELDS)
    ids = backend.tokenize(prompt)
    backend.validate(ids, params)
    return ParsedRequest(ids, params, **common)


def parse_chat(body: dict, backend) -> ParsedRequest:
    common = _common(body, backend)
    fields = body.copy()
    if fields.get("max_completion_tokens") is not None:  # the newer name wins over max_tokens
        fields["max_tokens"] = fields["max_completion_tokens"]
    logprobs, top = _flag(body, "logprobs"), body.get("top_logprobs")
    fields.pop("logprobs", None)
    if top is not None and not logprobs:
        raise InvalidRequest("top_logprobs", "needs \"logprobs\": true")
    if logprobs:
        fields["logprobs"] = 0 if top is None else top
    # Template inputs beyond the messages (vLLM's names), passed on only when the request has them.
    # (`tools` is refused above: no tool-call parser turns the answer into tool_calls yet.)
    template = {"documents": body["documents"]} if body.get("documents") is not None else {}
    if body.get("chat_template_kwargs") is not None:
        template["template_kwargs"] = body["chat_template_kwargs"]
    ids = backend.chat_token_ids(_text_parts_joined(body.get("messages")), **template)
    if fields.get("max_tokens") is None:  # a chat answer runs to its end, not to a legacy 16 tokens
        fields["max_tokens"] = backend.output_room(ids)
    try:
        params = sampling_params(fields, SamplingParams(), SAMPLING_FIELDS)
        backend.validate(ids, params)
    except InvalidRequest as exc:  # name the field the way this request spelled it
        renamed = {"logprobs": "top_logprobs"}
        if body.get("max_completion_tokens") is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        if exc.field in renamed:
            raise InvalidRequest(renamed[exc.field], str(exc).split(": ", 1)[1]) from None
        raise
    return ParsedRequest(ids, params, **common)


def _text_parts_joined(messages: Any) -> Any:
    """Content given as text parts ([{"type": "text", "text": ...}], as newer clients send it)
    as one string; anything else goes to the template check unchanged."""
    if not isinstance(messages, list):
        return messages
    out = []
    for m in messages:
        parts = m.get("content") if isinstance(m, dict) else None
        if (isinstance(parts, list) and parts
                and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                        for p in parts)):
            m = {**m, "content": "".join(p["text"] for p in parts)}
        out.append(m)
    return out


def _flag(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(name, f"must be true or false, got {value!r:.40}")
    return bool(value)


# -- responses ------------------------------------------------------------------------------------


@dataclass
class Collected:
    """A whole (non-streaming) answer gathered from its chunks."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)

    def add(self, chunk) -> None:
        self.text.append(chunk.text)
        self.token_ids += chunk.token_ids
        self.logprobs += chunk.logprobs or []


class CompletionShape:
    """`/v1/completions`: `text_completion` objects; logprobs as {tokens, token_logprobs,
    top_logprobs, text_offset}."""

    prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, backend, parsed: ParsedRequest):
        self.backend, self.parsed = backend, parsed
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._offset = 0  # text_offset runs on across a stream's chunks

    def head(self, streaming: bool) -> dict:
        return {"id": self.id, "object": self.chunk_object if streaming else self.object, "created": self.created,
                "model": self.backend.model_name}

    def whole(self, got: Collected, finish_reason: str | None, usage: Usage | None) -> dict:
        choice = {"index": 0, "text": "".join(got.text), "logprobs": self._logprobs(got.logprobs),
                  "finish_reason": finish_reason}
        self._ids(choice, got.token_ids)
        return {**self.head(False), "choices": [choice], "usage": usage_dict(usage)}

    def opening(self) -> list[dict]:
        return []

    def delta(self, chunk) -> dict:
        choice = {"index": 0, "text": chunk.text, "logprobs": self._logprobs(chunk.logprobs or []),
                  "finish_reason": chunk.finish_reason if chunk.finished else None}
        self._ids(choice, chunk.token_ids)
        return {**self.head(True), "choices": [choice]}

    def usage_event(self, usage: Usage | None) -> dict:
        return {**self.head(True), "choices": [], "usage": usage_dict(usage)}

    def _ids(self, choice: dict, ids: list[int]) -> None:
        if self.parsed.return_token_ids:
            choice["token_ids"] = list(ids)

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if self.parsed.params.logprobs is None:
            return None
        tokens = [self._text(e.token_id) for e in entries]
        offsets = []
        for t in tokens:
            offsets.append(self._offset)
            self._offset += len(t)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{self._text(t): lp for t, lp in e.top} for e in entries],
                "text_offset": offsets}

    def _text(self, token_id: int) -> str:
        return self.backend.detokenize([token_id], skip_special_tokens=False)  # logprobs name every token


class ChatShape(CompletionShape):
    """`/v1/chat/completions`: `chat.completion` objects; a stream opens with the assistant
    role, then content deltas; logprobs as {content: [{token, logprob, bytes, top_logprobs}]}."""

    prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def whole(self, got: Collected, finish_reason: str | None, usage: Usage | None) -> dict:
        choice = {"index": 0, "message": {"role": "assistant", "content": "".join(got.text)},
                  "logprobs": self._logprobs(got.logprobs), "finish_reason": finish_reason}
        self._ids(choice, got.token_ids)
        return {**self.head(False), "choices": [choice], "usage": usage_dict(usage)}

    def opening(self) -> list[dict]:
        return [{**self.head(True), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]}]

    def delta(self, chunk) -> dict:
        choice = {"index": 0, "delta": {"content": chunk.text} if chunk.text or not chunk.finished else {},
                  "logprobs": self._logprobs(chunk.logprobs or []),
                  "finish_reason": chunk.finish_reason if chunk.finished else None}
        self._ids(choice, chunk.token_ids)
        return {**self.head(True), "choices": [choice]}

    def _logprobs(self, entries: list[TokenLogprobs]) -> dict | None:
        if self.parsed.params.logprobs is None:
            return None
        return {"content": [{**self._entry(e.token_id, e.logprob),
                             "top_logprobs": [self._entry(t, lp) for t, lp in e.top]} for e in entries]}

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self._text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def usage_dict(usage: Usage | None) -> dict:
    if usage is None:  # e.g. an aborted request's last chunk
        return {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    out = {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
           "total_tokens": usage.prompt_tokens + usage.completion_tokens,
           "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}
    if usage.spec_draft_tokens:  # speculative decoding ran (an extension: OpenAI has no such field)
        out["speculative"] = {"draft_tokens": usage.spec_draft_tokens, "accepted_tokens": usage.spec_accepted_tokens,
                              "verify_steps": usage.spec_steps, "acceptance_rate": usage.spec_acceptance_rate,
                              "accepted_per_step": usage.spec_accepted_per_step}
    return out
