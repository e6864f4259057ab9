"""How deeply a request's JSON may nest. Real requests stay far below the cap (a tool's JSON
schema is the deepest, some ten levels); anything recursive over a value nested hundreds
deep (the chat template's own walk, a template macro) would hit Python's recursion limit,
so the doors refuse such bodies before anything recurses over them."""
from __future__ import annotations

from typing import Any

MAX_DEPTH = 32  # levels of objects and arrays, the outermost one counted as 1
_NESTING = (dict, list, tuple)


def nests_deeper_than(value: Any, limit: int) -> bool:
    """Whether `value` holds more than `limit` levels of dicts and lists (tuples too).
    Walks level by level without recursion, so any depth is safe to ask about."""
    level = [value] if isinstance(value, _NESTING) else []
    for _ in range(limit):
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c) if isinstance(v, _NESTING)]
        if not level:
            return False
    return bool(level)
