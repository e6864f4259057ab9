"""Every string of a parsed JSON request must be text: encodable as UTF-8.

JSON's "\\ud800" escapes (and raw surrogate bytes, which json.loads lets through) decode to lone
UTF-16 surrogates, which Python strings can hold and UTF-8 cannot: one in a prompt fails the
tokenizer, in a cache salt the prefix hash, in anything a log line. The door checks the whole
body once, before reading any field, so each field's later code sees text only.
"""
from __future__ import annotations

from typing import Any

from engine.request_checks import check_text


def check_body_text(body: Any) -> None:
    """InvalidRequest naming the first string, or object key, in `body` (as json.loads returned
    it) that is not UTF-8-encodable, by its path: `messages[0].content[1].text`. A bad key is
    named by its object's path ("request" at the top)."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # by hand, not recursion: nesting depth is the client's choice
        path, value = stack.pop()
        if isinstance(value, str):
            check_text(value, path)
        elif isinstance(value, dict):
            for key in value:
                check_text(key, path or "request", what="has a key that is")
            stack.extend((f"{path}.{k}" if path else k, v) for k, v in reversed(value.items()))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
