"""Sampling fields from untyped JSON (a prompts-file line, an HTTP body) into SamplingParams.

SamplingParams checks ranges; the type checks JSON needs come first here, so a string where
a number belongs is an InvalidRequest naming the field, never a TypeError. A null field
means "use the default", as OpenAI clients send it.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from engine.sampling import InvalidRequest, SamplingParams

# Field -> the JSON types it accepts (bool is excluded from numbers explicitly below).
SAMPLING_FIELDS: dict[str, str] = {
    "max_tokens": "int", "temperature": "number", "top_p": "number", "top_k": "int",
    "min_p": "number", "seed": "int", "stop": "strings", "ignore_eos": "bool",
    "stop_token_ids": "ints", "speculate": "bool",  # speculate: false opts out of speculative decoding
    "logprobs": "int",  # top-n per token; the chat API's `logprobs: true, top_logprobs: n` maps onto it
}


def _integral(value: Any) -> Any:
    """An integral float (3.0: JSON Schema's integer too, and what some clients send) as its int."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _convert(name: str, value: Any) -> Any:
    kind = SAMPLING_FIELDS[name]
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind == "int" and (is_int or isinstance(_integral(value), int)):
        return _integral(value)
    if kind == "number" and (is_int or isinstance(value, float)):
        return value  # SamplingParams makes it a float (an int too large for one is refused there)
    if kind == "bool" and isinstance(value, bool):
        return value
    if kind == "ints" and isinstance(value, list):
        return tuple(map(_integral, value))  # SamplingParams checks each id
    if kind == "strings":
        if isinstance(value, str):
            return (value,)
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return tuple(value)
        raise InvalidRequest(name, f"must be a string or a list of strings, got {value!r}")
    expected = {"int": "an integer", "number": "a number", "bool": "true or false", "ints": "a list of integers"}[kind]
    raise InvalidRequest(name, f"must be {expected}, got {value!r}")


def sampling_params(fields: dict[str, Any], base: SamplingParams, allowed: Iterable[str]) -> SamplingParams:
    """`base` with the `allowed` fields present in `fields` replaced; raises InvalidRequest."""
    updates = {name: _convert(name, fields[name]) for name in allowed if fields.get(name) is not None}
    return dataclasses.replace(base, **updates)  # re-runs SamplingParams' own checks


def token_ids(value: Any, field_name: str) -> list[int]:
    """A JSON list of token ids (integral floats as their ints); the range check against the
    vocabulary is the engine's."""
    ids = list(map(_integral, value)) if isinstance(value, list) else value
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequest(field_name, f"must be a non-empty list of integer token ids, got {value!r:.80}")
    return ids
