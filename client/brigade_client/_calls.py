"""What the sync and async clients share: request building, credentials, the retry rule."""
from __future__ import annotations

import random
import time
from pathlib import Path

import grpc

from brigade_client.errors import BrigadeError
from brigade_client.v1 import brigade_pb2 as pb

SERVICE = "brigade.v1.Brigade"
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
            "ignore_eos", "logprobs")
BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 5.0


def generate_request(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     request_id: str = "", model: str = "", priority: int = 0, cache_salt: str = "",
                     session_id: str = "", **sampling) -> pb.GenerateRequest:
    """A GenerateRequest from a prompt (text or token ids) or chat `messages`; sampling keywords
    left out (or None) are left unset, so the server's defaults apply."""
    unknown = set(sampling) - set(SAMPLING)
    if unknown:
        raise TypeError(f"unknown sampling option(s) {sorted(unknown)}; known: {', '.join(SAMPLING)}")
    if (prompt is None) == (messages is None):
        raise TypeError("give exactly one of prompt (text or token ids) and messages")
    req = pb.GenerateRequest(request_id=request_id, model=model, priority=priority, cache_salt=cache_salt,
                             session_id=session_id)
    if messages is not None:
        req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    elif isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.sampling.SetInParent()
    for name, value in sampling.items():
        if value is None:
            continue
        if name == "stop" and isinstance(value, str):
            value = [value]
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend(value)
        else:
            setattr(req.sampling, name, value)
    return req


def tokenize_request(text: str | None, messages: list[dict] | None) -> pb.TokenizeRequest:
    if (text is None) == (messages is None):
        raise TypeError("give exactly one of text and messages")
    if text is not None:
        return pb.TokenizeRequest(text=text)
    req = pb.TokenizeRequest()
    req.chat.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages)
    return req


def credentials(tls: bool, root_certificates: bytes | str | Path | None) -> grpc.ChannelCredentials | None:
    """None for plaintext; TLS with the system roots, or with `root_certificates` (PEM bytes or a path)."""
    if not tls and root_certificates is None:
        return None
    if isinstance(root_certificates, (str, Path)):
        root_certificates = Path(root_certificates).read_bytes()
    return grpc.ssl_channel_credentials(root_certificates=root_certificates)


def channel_options(server_name: str | None) -> list[tuple[str, object]]:
    return [("grpc.ssl_target_name_override", server_name)] if server_name else []


def metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),) if token else ()


class Deadline:
    """One per call: retries share the caller's timeout rather than each getting a new one."""

    def __init__(self, timeout_s: float | None):
        self.at = None if timeout_s is None else time.monotonic() + timeout_s

    def left(self) -> float | None:
        return None if self.at is None else max(0.0, self.at - time.monotonic())


def retry_delay(err: BrigadeError, attempt: int, max_retries: int, deadline: Deadline) -> float | None:
    """Seconds to wait before retrying, or None to give up. Only UNAVAILABLE before the first
    token is retried (streams ask only then; a unary call's server says `started` when tokens
    existed), so a retry never runs a request twice. Full jitter, at least the server's hint."""
    if err.code != grpc.StatusCode.UNAVAILABLE or err.started or attempt >= max_retries:
        return None
    delay = max(err.retry_after_s or 0.0, random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** attempt)))
    left = deadline.left()
    return None if left is not None and delay >= left else delay
