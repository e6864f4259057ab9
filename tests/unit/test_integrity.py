"""Integrity: a model id names the exact weights; a checkpoint index cannot point
the loader out of its directory; the disk tier never writes or reads through a planted
symlink and makes its renames durable; a KV header that disagrees with its reservation is
refused before anything is allocated."""
from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from decode_worker.worker import DecodeWorker
from engine import CacheConfig, EngineConfig, LLMEngine
from engine.fingerprint import checkpoint_fingerprint, fingerprinted
from engine.hicache.disk_store import DiskStore
from engine.loader import CheckpointError, checkpoint_files
from engine.messages import GenerateRequest
from engine.presets import materialize
from kv_transfer import KVTransferError, TransferConfig, TransferRefused, inprocess_pair

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def copy_tiny(to: Path) -> Path:
    shutil.copytree(materialize("tiny"), to)
    return to


def test_the_model_id_carries_the_checkpoint_fingerprint(tmp_path: Path) -> None:
    a, b = copy_tiny(tmp_path / "one" / "m"), copy_tiny(tmp_path / "two" / "m")
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)  # two nodes' copies agree
    engine = LLMEngine(EngineConfig(model=str(a), dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=16)))
    assert engine.model_id == f"m@{checkpoint_fingerprint(a)}"
    (weights,) = b.glob("*.safetensors")
    tensors = load_file(weights)
    save_file({k: v * 1.01 for k, v in tensors.items()}, weights)  # a fine-tune: same names, shapes, sizes
    assert checkpoint_fingerprint(b) != checkpoint_fingerprint(a)
    config = json.loads((a / "config.json").read_text())
    (a / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)


def test_a_long_name_is_cut_to_fit_the_kv_header() -> None:
    model_id = fingerprinted("é" * 100, "0123456789abcdef")
    assert len(model_id.encode()) <= 128 and model_id.endswith("@0123456789abcdef")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/x.safetensors", "..", "", 7])
def test_an_index_cannot_name_a_shard_outside_the_model_directory(tmp_path: Path, shard) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"not ours")
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(CheckpointError, match="only a file name in the model directory"):
        checkpoint_files(model)


LAYOUT = {"dtype": "float32", "block_shape": [2, 2, 4, 2, 8]}
SHAPE = (2, 2, 4, 2, 8)


def store(tmp_path: Path) -> DiskStore:
    return DiskStore(tmp_path / "l3", 1 << 20, "tiny@x", LAYOUT, torch.float32, SHAPE)


def test_a_symlink_planted_at_a_temp_name_is_never_written_through(tmp_path: Path) -> None:
    s = store(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    h = bytes(range(32))
    # The temp name this thread writes to: the writer must refuse to follow it.
    tmp = s.dir / f".tmp-{h.hex()}-{os.getpid()}-{threading.get_ident()}"
    os.symlink(victim, tmp)
    assert not s.write(h, torch.ones(SHAPE))
    assert victim.read_text() == "precious"
    assert not os.path.lexists(tmp)  # the planted link is gone, its target untouched
    assert s.write(h, torch.ones(SHAPE)) and torch.equal(s.read(h), torch.ones(SHAPE))
    s.close()


def test_a_symlinked_block_file_is_quarantined_unread(tmp_path: Path) -> None:
    s = store(tmp_path)
    h = bytes(range(32))
    assert s.write(h, torch.ones(SHAPE))
    path = s.dir / f"{h.hex()}.kv"
    real = tmp_path / "real.kv"
    os.replace(path, real)
    os.symlink(real, path)
    assert s.read(h) is None and s.stats["quarantined"] == 1 and real.exists()
    s.close()
    os.symlink(real, path)  # and at a restart's re-index
    s = store(tmp_path)
    assert h not in s and s.stats["quarantined"] == 1
    assert not path.exists() and real.exists()
    s.close()


def test_the_directory_is_fsynced_after_each_rename(tmp_path: Path, monkeypatch) -> None:
    synced: list[bool] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)), real_fsync(fd)))
    s = store(tmp_path)
    assert s.write(bytes(32), torch.ones(SHAPE))
    assert synced == [False, True]  # the file, then its directory
    s.close()


def test_a_kv_header_that_disagrees_with_the_reservation_is_refused_unallocated() -> None:
    cfg = EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=64))
    decode = DecodeWorker("decode-h", cfg, TransferConfig(backend="gloo"))
    try:
        tx, rx = inprocess_pair(decode.layout)
        rx.peer = "prefill-h"
        decode.kv.attach(rx)
        handle = decode.reserve("r", 5, "prefill-h")  # 5 tokens: one block of 16
        assert handle is not None
        claims = 40  # three blocks: a buffer three times what was reserved
        kv = torch.zeros(2, decode.layout.num_layers, 3, decode.layout.block_size, decode.layout.num_kv_heads,
                         decode.layout.head_dim)
        refused: list[BaseException] = []

        def send() -> None:
            try:
                tx.send("r", kv, claims)
            except TransferRefused as exc:
                refused.append(exc)
        threading.Thread(target=send, daemon=True).start()
        with pytest.raises(KVTransferError, match="claims 40 tokens in 3 blocks; 5 in 1 were reserved"):
            decode.kv.wait(handle, GenerateRequest("r", [1] * 5))
        assert decode.kv.buffers.held_bytes == 0  # nothing was allocated for it
        for _ in range(100):
            if refused:
                break
            threading.Event().wait(0.05)
        assert refused and rx.stats.refused == 1
        assert decode.abort("r") is None and decode.engine.pool.num_free == decode.engine.pool.num_blocks
    finally:
        decode.close()
