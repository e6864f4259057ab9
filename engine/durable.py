"""Renames that survive a power loss.

A file written to a temp name and renamed into place is whole to every reader, but not to
the disk: ext4 and xfs may persist the rename before the data, so after a power loss the
final name holds a truncated file that a later run trusts (a cache entry is trusted by its
name). `publish` fsyncs what it renames (a file, or a directory with everything under it)
before the rename and the parent directory after it, so the rename, once durable, carries
whole data.
"""
from __future__ import annotations

import os
from pathlib import Path


def fsync(path: Path) -> None:
    """Flush one file's or directory's data and metadata to the disk."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file under `root`, then each directory after its contents, `root` last."""
    for here, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync(Path(here, name))
        fsync(Path(here))


def publish(src: Path, dst: Path, *, replace: bool = True) -> None:
    """Rename `src` to `dst` durably: `src` (and all under it) fsynced first, `dst`'s directory
    after. With replace=False an existing `dst` is an OSError (os.rename: a non-empty directory)."""
    if src.is_dir():
        fsync_tree(src)
    else:
        fsync(src)
    (os.replace if replace else os.rename)(src, dst)
    fsync(dst.parent)
