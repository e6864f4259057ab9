"""Chat templates rendered the way transformers' apply_chat_template renders them.

The template sees what transformers gives it: `messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...), and the caller's
own variables (e.g. Qwen3's `enable_thinking`), in jinja's immutable sandbox with
transformers' `raise_exception`, `strftime_now`, `tojson` (no HTML escaping) and loop
controls. Everything the template sees is rebuilt from plain JSON types first, at most
MAX_DEPTH levels deep. Checkpoints' templates are untrusted code: the sandbox refuses
attribute escapes, and each render has a time and size budget (engine/template_sandbox.py).

The caller's variables reach the template in one mapping beside ours, never as keyword
arguments, and may not use a name the renderer sets itself (RESERVED: the inputs above, every
special token's name whether or not the model sets it, the sandbox's globals such as
`raise_exception`, `range` and `namespace`, and jinja's own `self`, `loop`, ...): such a
variable is refused, naming the key, rather than silently dropped or allowed to change what
the template's own names mean.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext

from engine import template_sandbox as sandbox
from engine.json_nesting import MAX_DEPTH

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token",
                  "additional_special_tokens")
RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKENS,
                      "raise_exception", "strftime_now", "range", "dict", "lipsum", "cycler", "joiner", "namespace",
                      "self", "loop", "caller", "varargs", "kwargs", "super"})
MAX_TOJSON_INDENT = 16
JOIN_EVERY = 4096  # output pieces


class TemplateRefused(ValueError):
    """The template raised (its own raise_exception, an undefined call, a sandbox refusal, a
    budget spent), or its inputs cannot be rendered; `field` names the request field to fix."""

    def __init__(self, message: str, field: str = "messages", timed_out: bool = False):
        super().__init__(message)
        self.field, self.timed_out = field, timed_out


def render(template: str, messages: list[dict], *, tools: list[dict] | None = None,
           documents: list[dict] | None = None, add_generation_prompt: bool = True,
           special_tokens: Mapping[str, str] | None = None, variables: Mapping[str, Any] | None = None) -> str:
    """The template's text; TemplateRefused naming the field when it cannot be rendered.
    `variables` are the caller's own (chat_template_kwargs): a render failure is blamed on them
    when rendering without them fails differently (or not at all); one that ran out of time is
    not rendered again (that would double its cost) and is the messages' (what templates loop over)."""
    for key in variables or {}:
        if not isinstance(key, str) or key in RESERVED:
            raise TemplateRefused(f"{key!r:.60} is a name the renderer sets itself (reserved: "
                                  f"{', '.join(sorted(RESERVED))}); rename or drop it", "chat_template_kwargs")
    size = [0]  # the inputs' characters: a render may make a few times its input
    ours = {"messages": _plain(messages, "messages", size), "tools": _plain(tools, "tools", size),
            "documents": _plain(documents, "documents", size), "add_generation_prompt": bool(add_generation_prompt),
            **{k: v for k, v in (special_tokens or {}).items() if k in SPECIAL_TOKENS}}
    theirs = _plain(dict(variables or {}), "chat_template_kwargs", size)
    chars = sandbox.MAX_CHARS + 2 * size[0]
    try:
        return _run(template, {**theirs, **ours}, chars)
    except TemplateRefused as exc:
        if theirs and not exc.timed_out:
            try:
                _run(template, ours, chars)
                exc.field = "chat_template_kwargs"
            except TemplateRefused as without:
                if str(without) != str(exc):
                    exc.field = "chat_template_kwargs"
        raise


def _run(template: str, context: dict[str, Any], chars: int) -> str:
    budget = sandbox.Budget(chars=chars)
    token = sandbox.budgeted(budget)
    try:
        out, size = [], 0
        for piece in _compiled(template).generate(context):  # one mapping: no name can clash with an argument
            size += len(piece)
            if size > chars:
                raise sandbox.RenderOverBudget(f"the chat template's text would be over its {chars:,}-character budget")
            budget.tick()
            out.append(piece)
            if len(out) >= JOIN_EVERY:  # many tiny pieces would take far more memory than their characters
                out = ["".join(out)]
        return "".join(out)
    except RecursionError:
        raise TemplateRefused("the chat template recursed too deeply") from None
    except sandbox.RenderTimedOut as exc:
        raise TemplateRefused(str(exc), timed_out=True) from None
    except (jinja2.TemplateError, sandbox.RenderOverBudget) as exc:
        raise TemplateRefused(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a template's bad data access, whatever it raised, is the input's
        raise TemplateRefused(f"{type(exc).__name__}: {exc}"[:500]) from None
    finally:
        sandbox.release(token)


@lru_cache(maxsize=8)
def _compiled(template: str) -> jinja2.Template:
    env = sandbox.BudgetedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.add_filter("tojson", _tojson)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    del env.globals["lipsum"]  # lipsum(n, ...) builds n paragraphs in one call, past every budget check
    return env.from_string(template)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    if (isinstance(indent, int) and indent > MAX_TOJSON_INDENT) or (isinstance(indent, str)
                                                                    and len(indent) > MAX_TOJSON_INDENT):
        raise sandbox.RenderOverBudget(f"tojson's indent is over {MAX_TOJSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    raise jinja2.TemplateError(message)


def _plain(value: Any, field: str, size: list[int], depth: int = 0) -> Any:
    """JSON types only (a subclass's methods could be a way out of the sandbox), at most
    MAX_DEPTH levels deep (the walk recurses: deeper input is refused before it could)."""
    if value is None or type(value) in (int, float, bool):
        return value
    if isinstance(value, str):
        size[0] += len(value)
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, (dict, list, tuple)):
        if depth >= MAX_DEPTH:
            raise TemplateRefused(f"nested deeper than {MAX_DEPTH} levels of objects and arrays", field)
        if isinstance(value, dict):
            return {_plain(k, field, size, depth + 1): _plain(v, field, size, depth + 1) for k, v in value.items()}
        return [_plain(v, field, size, depth + 1) for v in value]
    return str(value)
