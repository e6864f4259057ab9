"""Chat templates rendered the way transformers' apply_chat_template renders them.

The template sees what transformers gives it: `messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...), and the caller's
own keyword arguments (e.g. Qwen3's `enable_thinking`), in jinja's immutable sandbox with
transformers' `raise_exception`, `strftime_now`, `tojson` (no HTML escaping) and loop
controls. Everything the template sees is rebuilt from plain JSON types first. Checkpoints'
templates are untrusted code: the sandbox refuses attribute escapes.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names the renderer passes itself; caller kwargs may not replace them.
RESERVED = ("messages", "tools", "documents")


class TemplateRefused(ValueError):
    """The template raised (its own raise_exception, an undefined call, a sandbox refusal)."""


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           documents: list[dict] | None = None, add_generation_prompt: bool = True,
           special_tokens: dict[str, str] | None = None, **kwargs: Any) -> str:
    try:
        return _compiled(template).render(
            messages=_plain(messages), tools=_plain(tools), documents=_plain(documents),
            add_generation_prompt=add_generation_prompt, **(special_tokens or {}), **_plain(kwargs))
    except jinja2.TemplateError as exc:
        raise TemplateRefused(str(exc)) from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:  # a template's bad data access
        raise TemplateRefused(f"{type(exc).__name__}: {exc}") from None


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _plain(value: Any) -> Any:
    """JSON types only (a subclass's methods could be a way out of the sandbox)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)
