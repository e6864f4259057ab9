"""Which string field of a serialized protobuf message holds bytes that are not UTF-8.

The protobuf runtime refuses such a message whole ("String field had bad UTF-8", naming no
field); the door walks the wire format once more, only then, to name the field the way every
other INVALID_ARGUMENT does: `chat.messages[1].content`, `sampling.stop[0]`, `cache_salt`.
"""
from __future__ import annotations

from collections import Counter

from google.protobuf.descriptor import Descriptor, FieldDescriptor

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5


def bad_text_field(descriptor: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """The path of the first string field in `data` (a `descriptor` message) whose bytes are not
    UTF-8, or None (none is, or the bytes are malformed otherwise: the parser's own error stands)."""
    try:
        return _walk(descriptor, memoryview(data), prefix)
    except IndexError:  # truncated: not a UTF-8 problem
        return None


def _walk(descriptor: Descriptor, data: memoryview, prefix: str) -> str | None:
    pos, seen = 0, Counter()
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            _, pos = _varint(data, pos)
        elif wire == _FIXED64:
            pos += 8
        elif wire == _FIXED32:
            pos += 4
        elif wire == _LENGTH:
            size, pos = _varint(data, pos)
            if pos + size > len(data):
                return None
            value, pos = data[pos:pos + size], pos + size
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            path = f"{prefix}{field.name}"
            if field.is_repeated:
                path += f"[{seen[number]}]"
                seen[number] += 1
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    str(value, "utf-8")
                except UnicodeDecodeError:
                    return path
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = _walk(field.message_type, value, path + ".")
                if found is not None:
                    return found
        else:  # groups (deprecated, unused here) or garbage
            return None
    return None


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")
