"""HiCache's disk tier: bad files are misses (quarantined, counted, recomputed right), and a
writer killed mid-write never leaves a readable partial file."""
import errno
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.block_hash import chain_hashes
from engine.hicache import disk_store
from engine.hicache.disk_store import QUARANTINE_KEEP, DiskStore, encode_block
from tests.helpers import assert_pool_clean
from tests.hicache_helpers import BLOCK, GREEDY, plain_engine, tiered_engine, tokens

PROMPT = tokens(64, seed=11)
FILLER = tokens(80, seed=12)
BAD_BLOCK = 5  # the prefix hit must stop here: blocks 0..4 from disk, the rest recomputed


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :]


def _other_model(data: bytes, h: bytes, layout: dict) -> bytes:
    return encode_block(h, torch.zeros(layout["block_shape"]), "some-other-model", layout)


CORRUPTIONS = {
    "truncated": lambda data, h, layout: data[: len(data) // 2],
    "empty": lambda data, h, layout: b"",
    "flipped_payload_byte": lambda data, h, layout: _flip(data, len(data) - 100),
    "flipped_header_byte": lambda data, h, layout: _flip(data, 20),
    "other_model": _other_model,
    "wrong_version": lambda data, h, layout: encode_block(h, torch.zeros(layout["block_shape"]), "tiny", layout,
                                                          version=2),
}


@pytest.fixture(scope="module")
def reference() -> list[int]:
    return plain_engine().generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_bad_disk_file_is_a_quarantined_miss(tmp_path, kind, reference):
    writer = tiered_engine(tmp_path, host_blocks=2)
    writer.generate([PROMPT], GREEDY)
    writer.generate([FILLER], GREEDY)
    writer.close()
    h = chain_hashes(PROMPT, BLOCK, writer.model_id)[BAD_BLOCK]
    path = tmp_path / f"{h.hex()}.kv"
    layout = writer.hicache.disk.layout
    bad = CORRUPTIONS[kind](path.read_bytes(), h, layout)
    path.write_bytes(bad)

    engine = tiered_engine(tmp_path, host_blocks=2)  # warm restart over the damaged directory
    out = engine.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == reference
    assert out.usage.cached_by_tier == {"disk": BAD_BLOCK * BLOCK}  # blocks after the bad one are unreachable
    stats = engine.stats()["hicache"]
    assert stats["quarantined_blocks"] == 1
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert [q.name.split(".")[0] for q in quarantined] == [h.hex()] and quarantined[0].read_bytes() == bad
    engine.close()  # the recomputed block may be stored again: then whole and readable
    again = tiered_engine(tmp_path, host_blocks=2)
    assert again.hicache.disk.stats["quarantined"] == 0
    assert h not in again.hicache.disk or again.hicache.disk.read(h) is not None
    again.close()


_WRITER = """
import sys, torch
from engine.hicache.disk_store import DiskStore
store = DiskStore(sys.argv[1], 1 << 40, "tiny", {"dtype": "float32", "block_shape": [2, 64, 64, 8]},
                  torch.float32, (2, 64, 64, 8))
print("ready", flush=True)
i = 0
while True:  # 512 KiB blocks named by their index; the payload is the index, so content is checkable
    i += 1
    store.write(i.to_bytes(32, "big"), torch.full((2, 64, 64, 8), float(i)))
"""


def test_kill_during_disk_writes_leaves_no_readable_partial_file(tmp_path):
    rng = random.Random(0)
    for _ in range(3):  # each run pays a torch import; three kills at random points
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(rng.uniform(0.05, 0.4))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    store = DiskStore(tmp_path, 1 << 40, "tiny", {"dtype": "float32", "block_shape": [2, 64, 64, 8]},
                      torch.float32, (2, 64, 64, 8))
    assert len(store) > 0
    assert store.stats["quarantined"] == 0  # every file under a final name is whole
    for h in list(store.index):
        kv = store.read(h)
        assert kv is not None and torch.equal(kv, torch.full_like(kv, float(int.from_bytes(h, "big"))))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]  # re-indexing swept them


def test_full_disk_stops_disk_writes_and_keeps_serving(tmp_path, reference, monkeypatch):
    """ENOSPC from every write. (Once made by temp files symlinked to /dev/full; the writer now
    refuses to open a temp file through a symlink, so the store's own write step raises it.)"""
    engine = tiered_engine(tmp_path, host_blocks=0)  # every block goes straight to disk

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(disk_store, "_write_all", full)
    hc = engine.hicache
    first = engine.generate([PROMPT], GREEDY)[0]
    hc.drain()
    stats = engine.stats()["hicache"]
    assert stats["disk_full"] is True and stats["disk"]["write_errors"] >= 1
    assert stats["disk_blocks"] == 0 and not list(tmp_path.glob("*.kv"))
    again = engine.generate([PROMPT], GREEDY)[0]  # served (from the device pool), no more disk writes
    hc.drain()
    assert first.token_ids == again.token_ids == reference
    assert engine.stats()["hicache"]["disk"]["write_errors"] == stats["disk"]["write_errors"]
    assert_pool_clean(engine)
    engine.close()


def test_quarantine_keeps_only_the_newest_bad_files(tmp_path):
    for i in range(QUARANTINE_KEEP + 6):
        (tmp_path / f"{(bytes([i]) * 32).hex()}.kv").write_bytes(b"not a block file")
    layout = {"dtype": "float32", "block_shape": [2, 2, 4, 2, 32]}
    store = DiskStore(tmp_path, 1 << 30, "tiny", layout, torch.float32, (2, 2, 4, 2, 32))
    assert len(store) == 0 and store.stats["quarantined"] == QUARANTINE_KEEP + 6
    assert len(list((tmp_path / "quarantine").iterdir())) == QUARANTINE_KEEP
    store.close()
