"""A GGUF file's key/value metadata, each value read as the type its consumer needs.

GGUF declares a type per value, but nothing says `attention.head_count` must be a positive
integer: a file may carry 0 (a ZeroDivisionError in the config), a string (a TypeError) or an
array. Every read here checks the declared type and the range, so a wrong value is a
GGUFError naming the key, never an exception from deep inside the conversion.
"""
from __future__ import annotations

import math
from typing import Any

from gguf import GGUFReader, GGUFValueType

from engine.gguf.weights import GGUFError

MAX_SIZE = 1 << 24  # any count or size in a config (layers, heads, widths, vocabulary, context)

_INTS = {GGUFValueType.UINT8, GGUFValueType.INT8, GGUFValueType.UINT16, GGUFValueType.INT16,
         GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.UINT64, GGUFValueType.INT64}
_NUMBERS = _INTS | {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}
_REQUIRED: Any = object()


class Metadata:
    """Typed reads of `reader.fields`; a missing key gives `default`, or a GGUFError if none."""

    def __init__(self, reader: GGUFReader):
        self._fields = reader.fields

    def _types(self, key: str, default: Any) -> list[GGUFValueType] | None:
        f = self._fields.get(key)
        if f is None:
            if default is _REQUIRED:
                raise GGUFError(f"GGUF metadata {key!r} is missing; the file is not a complete checkpoint "
                                "of a supported model: re-export it with llama.cpp's converter")
            return None
        return f.types

    def _wrong(self, key: str, expected: str) -> GGUFError:
        f = self._fields[key]
        got = "/".join(t.name for t in f.types)
        value = f.contents() if f.types and f.types[0] != GGUFValueType.ARRAY else "an array"
        return GGUFError(f"GGUF metadata {key!r} must be {expected}, not {got} {value!r}; the file is malformed: "
                         "re-download or re-export it")

    def integer(self, key: str, default: Any = _REQUIRED, minimum: int = 1, maximum: int = MAX_SIZE) -> Any:
        types = self._types(key, default)
        if types is None:
            return default
        value = self._fields[key].contents() if types == [types[0]] and types[0] in _INTS else None
        if value is None or not minimum <= value <= maximum:
            raise self._wrong(key, f"an integer from {minimum} to {maximum}")
        return int(value)

    def number(self, key: str, default: Any = _REQUIRED) -> Any:
        """A positive, finite number."""
        types = self._types(key, default)
        if types is None:
            return default
        value = self._fields[key].contents() if types == [types[0]] and types[0] in _NUMBERS else None
        if value is None or not (math.isfinite(value) and value > 0):
            raise self._wrong(key, "a positive finite number")
        return value

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._scalar(key, default, GGUFValueType.STRING, "a string")

    def flag(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._scalar(key, default, GGUFValueType.BOOL, "a bool")
        return value if value is default else bool(value)

    def strings(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, default, {GGUFValueType.STRING}, "an array of strings")

    def integers(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._array(key, default, _INTS, "an array of integers")

    def _scalar(self, key: str, default: Any, kind: GGUFValueType, expected: str) -> Any:
        types = self._types(key, default)
        if types is None:
            return default
        if types != [kind]:
            raise self._wrong(key, expected)
        return self._fields[key].contents()

    def _array(self, key: str, default: Any, items: set[GGUFValueType], expected: str) -> Any:
        types = self._types(key, default)
        if types is None:
            return default
        # GGUFReader lists the item type only when there is an item: [ARRAY] is an empty array.
        if types[0] != GGUFValueType.ARRAY or not (types == [GGUFValueType.ARRAY]
                                                   or (len(types) == 2 and types[1] in items)):
            raise self._wrong(key, expected)
        return self._fields[key].contents()
