"""Invalid requests every front door must refuse with the field named (issue: front doors).

Each case is a request in neutral form (the OpenAI completion field names; `prompt` may be
text or token ids) built from the served model's limits, and the field the error must name.
The gRPC and HTTP tests map the neutral form onto their own messages.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Case:
    name: str
    request: Callable[[Limits], dict]
    field: str


CASES = [
    Case("empty prompt", lambda m: {"prompt": ""}, "prompt"),
    Case("empty token ids", lambda m: {"prompt": []}, "prompt"),
    Case("prompt over the context", lambda m: {"prompt": [1] * m.max_model_len}, "prompt"),
    Case("prompt + max_tokens over the context", lambda m: {"prompt": [1, 2], "max_tokens": m.max_model_len},
         "max_tokens"),
    Case("token id out of range", lambda m: {"prompt": [1, m.vocab_size]}, "prompt"),
    Case("negative token id", lambda m: {"prompt": [1, -1]}, "prompt"),
    Case("max_tokens zero", lambda m: {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    Case("temperature negative", lambda m: {"prompt": "hi", "temperature": -0.5}, "temperature"),
    Case("temperature not finite", lambda m: {"prompt": "hi", "temperature": float("inf")}, "temperature"),
    Case("top_p zero", lambda m: {"prompt": "hi", "top_p": 0.0}, "top_p"),
    Case("top_p above one", lambda m: {"prompt": "hi", "top_p": 1.5}, "top_p"),
    Case("top_k below -1", lambda m: {"prompt": "hi", "top_k": -2}, "top_k"),
    Case("min_p above one", lambda m: {"prompt": "hi", "min_p": 1.5}, "min_p"),
    Case("min_p negative", lambda m: {"prompt": "hi", "min_p": -0.1}, "min_p"),
    Case("logprobs over the cap", lambda m: {"prompt": "hi", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    Case("too many stop strings", lambda m: {"prompt": "hi", "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]},
         "stop"),
]
