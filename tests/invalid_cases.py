"""Invalid requests every front door must refuse with the field named (issue: front doors).

Each case is a request in neutral form (the OpenAI completion field names; `prompt` may be
text or token ids) built from the served model's limits, and the field the error must name.
The gRPC and HTTP tests map the neutral form onto their own messages; a case whose value the
proto's field type cannot even hold (an int64 field given 2**63) is for the JSON door only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.sampling import MAX_LOGPROBS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKENS_LIMIT


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Case:
    name: str
    request: Callable[[Limits], dict]
    field: str
    doors: tuple[str, ...] = ("http", "grpc")


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
    # Values that once overflowed a tensor in the sampler and killed the engine, or
    # that would make one request's step work grow without bound.
    Case("top_k past int64", lambda m: {"prompt": "hi", "max_tokens": 4, "top_k": 2**63, "top_p": 0.5}, "top_k",
         ("http",)),
    Case("top_k over the vocabulary", lambda m: {"prompt": "hi", "top_k": m.vocab_size + 1}, "top_k"),
    Case("top_k int32 max", lambda m: {"prompt": "hi", "top_k": 2**31 - 1}, "top_k"),
    Case("seed past uint64", lambda m: {"prompt": "hi", "seed": 2**64}, "seed", ("http",)),
    Case("seed below int64", lambda m: {"prompt": "hi", "seed": -(2**63) - 1}, "seed", ("http",)),
    Case("max_tokens past int64", lambda m: {"prompt": "hi", "max_tokens": 2**64}, "max_tokens", ("http",)),
    Case("max_tokens over the cap", lambda m: {"prompt": "hi", "max_tokens": MAX_TOKENS_LIMIT + 1}, "max_tokens"),
    Case("temperature past float", lambda m: {"prompt": "hi", "temperature": 10**400}, "temperature", ("http",)),
    Case("logprobs negative", lambda m: {"prompt": "hi", "logprobs": -1}, "logprobs"),
    Case("stop string too long", lambda m: {"prompt": "hi", "stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    Case("stop strings too long together", lambda m: {"prompt": "hi", "stop": ["y" * MAX_STOP_CHARS] * 5}, "stop"),
    Case("too many stop token ids", lambda m: {"prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
         "stop_token_ids"),
    Case("stop token id out of range", lambda m: {"prompt": "hi", "stop_token_ids": [m.vocab_size]},
         "stop_token_ids"),
    Case("stop token id past int64", lambda m: {"prompt": "hi", "stop_token_ids": [2**63]}, "stop_token_ids",
         ("http",)),
    Case("negative stop token id", lambda m: {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
]

HTTP_CASES = [c for c in CASES if "http" in c.doors]
GRPC_CASES = [c for c in CASES if "grpc" in c.doors]
