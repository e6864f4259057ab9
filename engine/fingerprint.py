"""A checkpoint's fingerprint: which exact weights a model id stands for."""
from __future__ import annotations

import hashlib
import struct
from pathlib import Path

MAX_HEADER_BYTES = 100 << 20  # safetensors caps its JSON header at 100 MB


SAMPLE_BYTES = 64 << 10


def checkpoint_fingerprint(path: Path) -> str:
    """16 hex digits naming these exact weights: config.json, and every safetensors file's
    name, size, header (tensor names, dtypes, shapes, offsets) and the first and last 64 KiB
    of its tensor bytes (a fine-tune of the same shapes differs there too), so it costs a
    few reads, never a pass over the weights. Part of the model id: KV cached for other
    weights under the same name (a disk tier left from a swapped checkpoint) never matches,
    while two copies of the same files (two nodes) agree."""
    digest = hashlib.sha256(b"brigade-checkpoint-v1")
    files = [path] if path.is_file() else [path / "config.json", *sorted(path.glob("*.safetensors"))]
    for f in files:
        if not f.is_file():
            continue
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            start = 0
            if f.suffix == ".safetensors" and size >= 8:
                n = min(struct.unpack("<Q", fh.read(8))[0], MAX_HEADER_BYTES)  # the JSON header's length
                digest.update(fh.read(n))
                start = 8 + n
            fh.seek(start)
            digest.update(fh.read(SAMPLE_BYTES))  # config.json whole; a GGUF file's header
            fh.seek(max(start, size - SAMPLE_BYTES))
            digest.update(fh.read(SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def fingerprinted(name: str, fingerprint: str, max_bytes: int = 128) -> str:
    """"name@fingerprint", the name cut so the whole fits a KV header's model_id field."""
    room = max_bytes - len(fingerprint) - 1
    cut = name.encode("utf-8")[:room].decode("utf-8", errors="ignore")
    return f"{cut}@{fingerprint}"
