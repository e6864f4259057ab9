"""L3: KV blocks as files in a local directory under a byte budget.

One file per block, named `<hash hex>.kv`:

    magic  b"BRGKVBLK"                      8 bytes
    format version                          u16 little-endian
    header length H                         u32 little-endian
    header                                  H bytes of UTF-8 JSON: model_id, layout
                                            {dtype, block_shape}, hashes [hex], payload_bytes
    payload                                 the block's KV, raw, C order (2, L, bs, Hkv, hd)
    checksum                                16 bytes: xxh3_128 of everything before it

Files are written to a temp name (created exclusively, never through a symlink), fsynced
and renamed, and the directory is fsynced after the rename, so a reader sees a whole file or
none, also after a power loss; reads never follow a symlink either (something planted in the
directory is not ours, and is quarantined). A file that is truncated, fails its checksum,
belongs to another model or layout, has another format version, or a header that is oversized or nested past
what json parses is a miss: it is moved to `quarantine/` (the newest QUARANTINE_KEEP are kept), logged and
counted, never decoded. Nothing in the directory is stat()ed through a symlink, and a file that vanishes
meanwhile (another process's cleanup, an eviction) is skipped. A full disk (ENOSPC) stops writes; reads go on.

Thread-safe: the tier manager's I/O thread writes and reads while the engine thread looks
blocks up; `take_changes()` hands the engine thread what became findable or stopped
being findable, in order, for its cache events.
"""
from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import stat
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch
import xxhash

log = logging.getLogger(__name__)

MAGIC = b"BRGKVBLK"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHI")  # magic, version, header length
_DIGEST = 16
_SUFFIX = ".kv"
_TMP = ".tmp-"
QUARANTINE_KEEP = 64  # bad files kept for inspection; older ones are deleted so the directory stays bounded
MAX_HEADER_BYTES = 1 << 16  # ours are ~300 bytes; a longer one is not ours and is not parsed


class BadBlockFile(ValueError):
    """A block file that must not be decoded."""


def encode_block(h: bytes, kv: torch.Tensor, model_id: str, layout: dict,
                 version: int = FORMAT_VERSION) -> bytes:
    payload = kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    header = json.dumps({"model_id": model_id, "layout": layout, "hashes": [h.hex()],
                         "payload_bytes": len(payload)}, sort_keys=True).encode()
    body = _PREFIX.pack(MAGIC, version, len(header)) + header + payload
    return body + xxhash.xxh3_128_digest(body)


def _check_header(prefix: bytes, header: bytes, h: bytes, model_id: str, layout: dict) -> int:
    """Validate a file's fixed prefix and header; returns the payload size."""
    if len(prefix) < _PREFIX.size:
        raise BadBlockFile("truncated")
    magic, version, hlen = _PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise BadBlockFile("not a block file")
    if version != FORMAT_VERSION:
        raise BadBlockFile(f"format version {version}, expected {FORMAT_VERSION}")
    if hlen > MAX_HEADER_BYTES or len(header) != hlen:
        raise BadBlockFile(f"header of {hlen} bytes ({len(header)} present; at most {MAX_HEADER_BYTES})")
    try:
        meta = json.loads(header)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadBlockFile(f"header: {e}") from None
    except RecursionError:  # nested deeper than json parses: not a header we wrote
        raise BadBlockFile("header nested too deep") from None
    if not isinstance(meta, dict):
        raise BadBlockFile("header is not an object")
    if meta.get("model_id") != model_id:
        raise BadBlockFile(f"model {meta.get('model_id')!r}, expected {model_id!r}")
    if meta.get("layout") != layout:
        raise BadBlockFile(f"layout {meta.get('layout')!r}, expected {layout!r}")
    if meta.get("hashes") != [h.hex()]:
        raise BadBlockFile("block hash differs from the file name")
    size = meta.get("payload_bytes")
    if not isinstance(size, int) or size < 0:
        raise BadBlockFile("bad payload_bytes")
    return size


class DiskStore:
    def __init__(self, directory: str | Path, budget: int, model_id: str, layout: dict, dtype: torch.dtype,
                 block_shape: tuple[int, ...]):
        self.dir = Path(directory)
        self.budget = budget
        self.model_id = model_id
        self.layout = layout
        self.dtype = dtype
        self.block_shape = block_shape
        self.block_bytes = _numel(block_shape) * torch.empty((), dtype=dtype).element_size()
        self.quarantine_dir = self.dir / "quarantine"
        self.index: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self.used_bytes = 0
        self.full = False  # set on ENOSPC: no more writes
        self.stats = {"bytes_written": 0, "bytes_read": 0, "blocks_written": 0, "blocks_read": 0,
                      "quarantined": 0, "write_errors": 0, "evicted": 0}
        self._changes: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.dir.chmod(0o700)  # mkdir's mode is masked by umask and ignored for an existing dir
        # One store per directory: two would each index, evict and budget the same files.
        # A file object, so the lock also goes when an unclosed store is garbage-collected.
        self._dir_lock = open(os.open(self.dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600), "rb")
        try:
            fcntl.flock(self._dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._dir_lock.close()
            raise ValueError(f"hicache disk_dir {self.dir} is in use by another engine; "
                             "give each engine its own directory") from None
        self._dir_fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        self._reindex()

    def close(self) -> None:
        """Release the directory (also done when the store is collected or the process dies)."""
        self._dir_lock.close()
        if self._dir_fd >= 0:
            os.close(self._dir_fd)
            self._dir_fd = -1

    # -- lookups ---------------------------------------------------------------------
    def __contains__(self, h: bytes) -> bool:
        with self._lock:
            return h in self.index

    def __len__(self) -> int:
        return len(self.index)

    def take_changes(self) -> list[tuple[str, bytes]]:
        """("stored" | "removed", hash) since the last call, in the order they happened."""
        with self._lock:
            out, self._changes = self._changes, []
        return out

    # -- reads -----------------------------------------------------------------------
    def read(self, h: bytes) -> torch.Tensor | None:
        """The block's KV, (2, L, bs, Hkv, hd) on the CPU, or None: absent, or bad (quarantined)."""
        with self._lock:
            if h not in self.index:
                return None
            self.index.move_to_end(h)
        path = self._path(h)
        try:
            data = _read_file(path)
        except FileNotFoundError:  # evicted meanwhile
            self._drop(h)
            return None
        except OSError as e:
            self._quarantine(h, f"unreadable: {e}")
            return None
        try:
            kv = self._decode(h, data)
        except BadBlockFile as e:
            self._quarantine(h, str(e))
            return None
        with self._lock:
            self.stats["bytes_read"] += len(data)
            self.stats["blocks_read"] += 1
        return kv

    def _decode(self, h: bytes, data: bytes) -> torch.Tensor:
        if len(data) < _PREFIX.size + _DIGEST:
            raise BadBlockFile(f"truncated ({len(data)} bytes)")
        _, _, hlen = _PREFIX.unpack_from(data)
        end = _PREFIX.size + hlen
        size = _check_header(data[: _PREFIX.size], data[_PREFIX.size : end], h, self.model_id, self.layout)
        if len(data) != end + size + _DIGEST:
            raise BadBlockFile(f"size {len(data)}, header says {end + size + _DIGEST}")
        if xxhash.xxh3_128_digest(memoryview(data)[:-_DIGEST]) != data[-_DIGEST:]:
            raise BadBlockFile("checksum mismatch")
        if size != self.block_bytes:
            raise BadBlockFile(f"payload {size} bytes, expected {self.block_bytes}")
        payload = bytearray(memoryview(data)[end : end + size])
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).reshape(self.block_shape)

    # -- writes ----------------------------------------------------------------------
    def write(self, h: bytes, kv: torch.Tensor) -> bool:
        """Store one block durably (temp file, fsync, rename), evicting least recently used
        files to stay in budget. False when not stored: disk full, over budget, or an I/O error."""
        data = encode_block(h, kv, self.model_id, self.layout)
        with self._lock:
            if h in self.index:
                self.index.move_to_end(h)
                return True
            if self.full or len(data) > self.budget:
                return False
            while self.index and self.used_bytes + len(data) > self.budget:
                old, size = self.index.popitem(last=False)
                self.used_bytes -= size
                self.stats["evicted"] += 1
                self._changes.append(("removed", old))
                _unlink(self._path(old))
        path = self._path(h)
        tmp = self.dir / f"{_TMP}{h.hex()}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                _write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            os.fsync(self._dir_fd)  # the rename itself is durable only once the directory is
        except OSError as e:
            _unlink(tmp)
            with self._lock:
                self.stats["write_errors"] += 1
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    self.full = True
            log.warning("hicache: L3 write of %s failed (%s)%s", h.hex()[:16], e,
                        "; disk full, L3 writes stop" if self.full else "")
            return False
        with self._lock:
            self.index[h] = len(data)
            self.used_bytes += len(data)
            self.stats["bytes_written"] += len(data)
            self.stats["blocks_written"] += 1
            self._changes.append(("stored", h))
        return True

    # -- bookkeeping -----------------------------------------------------------------
    def _path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}{_SUFFIX}"

    def _drop(self, h: bytes) -> None:
        with self._lock:
            size = self.index.pop(h, None)
            if size is not None:
                self.used_bytes -= size
                self._changes.append(("removed", h))

    def _quarantine(self, h: bytes, why: str, path: Path | None = None) -> None:
        self._drop(h)
        path = path or self._path(h)
        self._quarantine_dir()
        try:
            os.replace(path, self.quarantine_dir / f"{path.name}.{time.time_ns()}")
        except FileNotFoundError:
            pass
        except OSError as e:  # not movable (a directory under a block name, permissions): leave it unindexed
            log.warning("hicache: could not move bad L3 file %s to quarantine (%s)", path.name, e)
        kept = sorted(_entries_by_age(self.quarantine_dir))
        for _, old in kept[: max(0, len(kept) - QUARANTINE_KEEP)]:
            _unlink(old)
        with self._lock:
            self.stats["quarantined"] += 1
        log.warning("hicache: quarantined L3 block file %s: %s", path.name, why)

    def _quarantine_dir(self, create: bool = True) -> None:
        """Make `quarantine/` a real directory (or nothing): one planted as a symlink would have bad
        files moved, and the oldest files deleted, wherever it points."""
        try:
            if stat.S_ISDIR(os.lstat(self.quarantine_dir).st_mode):
                return
            _unlink(self.quarantine_dir)
        except FileNotFoundError:
            pass
        if not create:
            return
        try:
            os.mkdir(self.quarantine_dir, 0o700)
        except FileExistsError:  # made meanwhile by another thread of this store
            pass

    def _reindex(self) -> None:
        """Warm restart: index every valid block file (by age, oldest first); drop temp files
        a killed writer left; quarantine files that are not ours or not whole."""
        found: list[tuple[float, bytes, int]] = []
        self._quarantine_dir(create=False)
        for entry in os.scandir(self.dir):
            if entry.name == self.quarantine_dir.name:
                continue
            if not entry.is_file(follow_symlinks=False):
                if entry.is_symlink():
                    self._quarantine(b"", "a symlink, not a block file of ours", Path(entry.path))
                continue
            if entry.name.startswith(_TMP):
                _unlink(Path(entry.path))
                continue
            if not entry.name.endswith(_SUFFIX):
                continue
            path = Path(entry.path)
            try:
                h = bytes.fromhex(entry.name[: -len(_SUFFIX)])
                st = entry.stat(follow_symlinks=False)
                with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
                    prefix = f.read(_PREFIX.size)
                    hlen = _PREFIX.unpack_from(prefix)[2] if len(prefix) == _PREFIX.size else 0
                    size = _check_header(prefix, f.read(min(hlen, MAX_HEADER_BYTES)), h, self.model_id, self.layout)
                if st.st_size != _PREFIX.size + hlen + size + _DIGEST:
                    raise BadBlockFile(f"size {st.st_size} does not match its header")
            except FileNotFoundError:  # removed since the scan listed it: nothing to index or quarantine
                continue
            except (ValueError, OSError) as e:
                self._quarantine(b"", str(e), path)
                continue
            found.append((st.st_mtime, h, st.st_size))
        for _, h, size in sorted(found):
            self.index[h] = size
            self.used_bytes += size
        while self.index and self.used_bytes > self.budget:  # the budget may have shrunk
            old, size = self.index.popitem(last=False)
            self.used_bytes -= size
            _unlink(self._path(old))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_file(path: Path) -> bytes:
    """The whole file, never through a symlink (ELOOP, an OSError, if it is one)."""
    with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW), "rb") as f:
        return f.read()


def _entries_by_age(directory: Path) -> list[tuple[float, Path]]:
    """(mtime, path) of each entry, by lstat: a dangling or planted symlink is aged, never followed;
    an entry removed meanwhile is skipped."""
    out = []
    for entry in os.scandir(directory):
        try:
            out.append((entry.stat(follow_symlinks=False).st_mtime, Path(entry.path)))
        except FileNotFoundError:
            continue
    return out


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
