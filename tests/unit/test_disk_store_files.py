"""The disk tier starts, and keeps serving, whatever lies in its directory: dangling symlinks,
headers nested past what json parses or longer than any of ours, files that vanish while the
start-up scan reads them, and a `quarantine` planted as a symlink."""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from engine.hicache.disk_store import MAGIC, MAX_HEADER_BYTES, DiskStore

LAYOUT = {"dtype": "float32", "block_shape": [2, 2, 4, 2, 8]}
SHAPE = (2, 2, 4, 2, 8)
H = bytes(range(32))


def store(tmp_path: Path) -> DiskStore:
    return DiskStore(tmp_path / "l3", 1 << 20, "tiny@x", LAYOUT, torch.float32, SHAPE)


def block_file(directory: Path, h: bytes, header: bytes) -> Path:
    """A block file whose header is `header`, with a payload and checksum-sized tail."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{h.hex()}.kv"
    path.write_bytes(struct.pack("<8sHI", MAGIC, 1, len(header)) + header + bytes(64))
    return path


def test_a_dangling_symlink_does_not_stop_the_store_starting(tmp_path: Path) -> None:
    (tmp_path / "l3").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "l3" / f"{H.hex()}.kv")
    s = store(tmp_path)
    assert H not in s and s.stats["quarantined"] == 1
    assert [p.name.split(".")[0] for p in (tmp_path / "l3" / "quarantine").iterdir()] == [H.hex()]
    s.close()
    os.symlink(tmp_path / "gone", tmp_path / "l3" / f"{bytes(32).hex()}.kv")  # quarantine now ages a dangling link
    s = store(tmp_path)
    assert s.stats["quarantined"] == 1 and len(os.listdir(tmp_path / "l3" / "quarantine")) == 2
    assert s.write(H, torch.ones(SHAPE)) and torch.equal(s.read(H), torch.ones(SHAPE))
    s.close()


@pytest.mark.parametrize("depth", [30_000, 100_000])  # under the header bound (json's recursion), over it
def test_a_deeply_nested_header_is_a_quarantined_bad_file(tmp_path: Path, depth: int) -> None:
    header = b"[" * depth + b"]" * depth
    assert (len(header) > MAX_HEADER_BYTES) == (depth == 100_000)
    block_file(tmp_path / "l3", H, header)
    s = store(tmp_path)  # start-up: the re-index
    assert H not in s and s.stats["quarantined"] == 1
    assert s.write(H, torch.ones(SHAPE))
    block_file(tmp_path / "l3", H, header)  # and a read of a file indexed as whole
    assert s.read(H) is None and s.stats["quarantined"] == 2 and H not in s
    assert len(os.listdir(tmp_path / "l3" / "quarantine")) == 2
    s.close()


def test_a_file_removed_during_the_scan_is_skipped_not_quarantined(tmp_path: Path, monkeypatch) -> None:
    s = store(tmp_path)
    keep, gone = bytes(32), H
    assert s.write(keep, torch.ones(SHAPE)) and s.write(gone, torch.zeros(SHAPE))
    s.close()
    real_open = os.open

    def removed_first(path, *args, **kwargs):  # another process's cleanup wins the race for this one
        if str(path).endswith(f"{gone.hex()}.kv"):
            os.unlink(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", removed_first)
    s = store(tmp_path)
    monkeypatch.undo()
    assert keep in s and gone not in s and s.stats["quarantined"] == 0
    assert not (tmp_path / "l3" / "quarantine").exists()
    s.close()


def test_a_quarantine_planted_as_a_symlink_is_never_followed(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    (tmp_path / "l3").mkdir()
    os.symlink(victim, tmp_path / "l3" / "quarantine")
    block_file(tmp_path / "l3", H, json.dumps({"model_id": "another@y"}).encode())
    s = store(tmp_path)
    assert H not in s and s.stats["quarantined"] >= 1
    assert os.listdir(victim) == ["precious"] and (victim / "precious").read_text() == "keep me"
    q = tmp_path / "l3" / "quarantine"
    assert q.is_dir() and not q.is_symlink() and [p.name.split(".")[0] for p in q.iterdir()] == [H.hex()]
    s.close()
