"""Check a GGUF file's header, within stated bounds, before the `gguf` package parses it.

GGUFReader trusts every count it reads: it builds numpy views for each array item (~1.1 KB
of memory apiece: Qwen2.5's 455k vocabulary items cost it ~0.5 GB, and a 1 MB file holding
one ARRAY<UINT8> of a million items ~1 GB and 10 s), recurses into nested arrays, and meets a
malformed file with KeyError, UnicodeDecodeError or a numpy error. `check_header` walks the
same header (counts, keys, every value, tensor infos) over a memory map, touching each item
once and allocating nothing per scalar item, and refuses what falls outside the bounds below
with a GGUFError naming the key (or tensor); only then is the file handed to GGUFReader.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

from engine.gguf.weights import GGUFError

VERSIONS = (2, 3)  # what GGUFReader reads
MAX_TENSORS = 1 << 16  # a dense model has ~10 per layer; the largest MoE files a few thousand
MAX_KVS = 1 << 12  # real files carry 30-60 keys
MAX_NAME_BYTES = 1 << 10  # a key or tensor name (llama.cpp's names are under 64 bytes)
MAX_STRING_BYTES = 1 << 24  # one string value: a chat template is ~10 KB, a token a few bytes
MAX_ARRAY_ITEMS = 1 << 19  # one array: Qwen's tokens hold 151,936 strings, Gemma's 262,144
MAX_TOTAL_ITEMS = 1 << 20  # all arrays together: Qwen2.5 holds 455k items, Gemma ~790k
MAX_ARRAY_DEPTH = 2  # an array of arrays at most (GGUFReader recurses per level)
MAX_DIMS = 4  # GGML_MAX_DIMS

STRING, ARRAY = 8, 9
# GGUFValueType -> struct format of a scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# Names GGUFReader files its own header under: a key spelled so would collide with them.
_RESERVED = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")


class _Scan:
    def __init__(self, data: mmap.mmap | bytes, path: Path, order: str):
        self.data, self.path, self.order = data, path, order
        self.offset = 0
        self.items = 0
        self.what = "the header"  # the key or tensor being read, for the error

    def fail(self, why: str) -> GGUFError:
        return GGUFError(f"{self.path}: GGUF {self.what}: {why}; the file is malformed or not a GGUF "
                         "checkpoint: re-download or re-export it")

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.data):
            raise self.fail(f"ends at byte {len(self.data)}, inside its own header (the file is truncated)")
        value = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return value[0] if len(value) == 1 else value

    def skip(self, size: int) -> None:
        if self.offset + size > len(self.data):
            raise self.fail(f"needs {size} bytes at byte {self.offset}, past the file's end at "
                            f"{len(self.data)} (the file is truncated)")
        self.offset += size

    def string(self, limit: int) -> str:
        size = self.take("Q")
        if size > limit:
            raise self.fail(f"a string of {size} bytes; at most {limit} are accepted")
        start = self.offset
        self.skip(size)
        try:
            return bytes(self.data[start:self.offset]).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"a string that is not UTF-8 ({exc.reason} at byte {start + exc.start})") from None

    def value(self, kind: int, depth: int = 0):
        """Walk one value of GGUFValueType `kind`; returns it only when it is a scalar."""
        if kind in _SCALARS:
            return self.take(_SCALARS[kind])
        if kind == STRING:
            self.string(MAX_STRING_BYTES)
            return None
        if kind != ARRAY:
            raise self.fail(f"value type {kind} is not a GGUF type")
        if depth >= MAX_ARRAY_DEPTH:
            raise self.fail(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item, count = self.take("I"), self.take("Q")
        if count > MAX_ARRAY_ITEMS:
            raise self.fail(f"an array of {count} items; at most {MAX_ARRAY_ITEMS} are accepted")
        self.items += count
        if self.items > MAX_TOTAL_ITEMS:
            raise self.fail(f"its array brings the file's array items to {self.items}; at most "
                            f"{MAX_TOTAL_ITEMS} are accepted in all")
        if item in _SCALARS:  # fixed size: bounds-checked at once, not item by item
            self.skip(count * struct.calcsize(_SCALARS[item]))
        else:
            for _ in range(count):
                self.value(item, depth + 1)
        return None


def check_header(path: str | Path) -> None:
    """GGUFError (naming the key or tensor) unless `path`'s header is one GGUFReader can parse
    within the bounds above: magic, version, counts, unique UTF-8 keys of known types, strings
    and arrays in bounds, tensor infos of known quantization types whose data lies in the file."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise GGUFError(f"{path} is not a readable GGUF file: {size} bytes, fewer than its header needs")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check(data, path)
    except OSError as exc:
        raise GGUFError(f"{path} is not a readable GGUF file: {exc}") from None


def _check(data: mmap.mmap, path: Path) -> None:
    if data[:4] != b"GGUF":
        raise GGUFError(f"{path} is not a readable GGUF file: it does not start with the GGUF magic")
    version = struct.unpack_from("<I", data, 4)[0]
    order = ">" if version & 0xFFFF == 0 else "<"  # written on a big-endian host, as GGUFReader decides
    scan = _Scan(data, path, order)
    scan.offset = 4
    version = scan.take("I")
    if version not in VERSIONS:
        raise scan.fail(f"version {version}; only {' and '.join(map(str, VERSIONS))} are read")
    scan.what = "tensor_count"
    tensors = scan.take("Q")
    if tensors > MAX_TENSORS:
        raise scan.fail(f"{tensors} tensors; at most {MAX_TENSORS} are accepted")
    scan.what = "kv_count"
    kvs = scan.take("Q")
    if kvs > MAX_KVS:
        raise scan.fail(f"{kvs} metadata keys; at most {MAX_KVS} are accepted")
    alignment = _check_kvs(scan, kvs)
    ends = _check_tensor_infos(scan, tensors)
    data_start = -(-scan.offset // alignment) * alignment
    for name, offset, nbytes in ends:
        scan.what = f"tensor {name!r}"
        if offset % alignment:
            raise scan.fail(f"data offset {offset} is not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > len(data):
            raise scan.fail(f"its data ends at byte {data_start + offset + nbytes}, past the file's end at "
                            f"{len(data)} (the file is truncated)")


def _check_kvs(scan: _Scan, count: int) -> int:
    """Walk the metadata; returns the file's alignment."""
    seen = set(_RESERVED)
    alignment = GGUF_DEFAULT_ALIGNMENT
    for i in range(count):
        scan.what = f"key #{i}"
        key = scan.string(MAX_NAME_BYTES)
        scan.what = f"key {key!r}"
        if key in seen:
            raise scan.fail("appears twice")
        seen.add(key)
        kind = scan.take("I")
        value = scan.value(kind)
        if key == "general.alignment":
            if kind != 4 or value == 0 or value & (value - 1):
                raise scan.fail("must be a UINT32 power of two")
            alignment = value
    return alignment


def _check_tensor_infos(scan: _Scan, count: int) -> list[tuple[str, int, int]]:
    """Walk the tensor infos; returns (name, data offset, data bytes) of each."""
    names: set[str] = set()
    out = []
    for i in range(count):
        scan.what = f"tensor #{i}"
        name = scan.string(MAX_NAME_BYTES)
        scan.what = f"tensor {name!r}"
        if name in names:
            raise scan.fail("appears twice")
        names.add(name)
        ndims = scan.take("I")
        if not 1 <= ndims <= MAX_DIMS:
            raise scan.fail(f"{ndims} dimensions; 1 to {MAX_DIMS} are accepted")
        dims = [scan.take("Q") for _ in range(ndims)]
        kind = scan.take("I")
        offset = scan.take("Q")
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
        except (ValueError, KeyError):
            raise scan.fail(f"quantization type {kind} is not a GGML type") from None
        if min(dims) < 1 or dims[0] % block:
            raise scan.fail(f"shape {dims} is not whole {GGMLQuantizationType(kind).name} blocks of {block}")
        elements = 1
        for d in dims:
            elements *= d
        out.append((name, offset, elements // block * type_size))
    return out
