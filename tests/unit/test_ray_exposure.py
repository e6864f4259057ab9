"""Ray closed to strangers: `brigade serve` with a non-loopback --host, or joining a
Ray cluster with --ray-address, refuses to start (exit 2, naming RAY_AUTH_MODE) unless Ray
token auth is on; loopback serving needs nothing."""
from __future__ import annotations

import pytest

from cluster.cli import main as brigade
from cluster.ray_auth import RayAuthOff, check_ray_exposure


@pytest.mark.parametrize(("host", "address", "env"), [
    ("10.0.0.5", None, {}),
    ("10.0.0.5", None, {"RAY_AUTH_MODE": "disabled"}),
    ("127.0.0.1", "10.0.0.1:6379", {}),
    ("127.0.0.1", "127.0.0.1:6379", {"RAY_AUTH_MODE": "disabled"}),  # whose Ray is it? auth says
    ("::ffff:10.0.0.5", None, {}),
])
def test_reachable_ray_without_token_auth_is_refused(host, address, env) -> None:
    with pytest.raises(RayAuthOff, match="RAY_AUTH_MODE"):
        check_ray_exposure(host, address, env)


@pytest.mark.parametrize(("host", "address", "env"), [
    ("127.0.0.1", None, {}),
    ("::1", None, {"RAY_AUTH_MODE": "disabled"}),
    ("localhost", None, {}),
    ("10.0.0.5", None, {"RAY_AUTH_MODE": "token"}),
    ("10.0.0.5", "10.0.0.1:6379", {"RAY_AUTH_MODE": "TOKEN"}),
])
def test_loopback_or_token_auth_passes(host, address, env) -> None:
    check_ray_exposure(host, address, env)


@pytest.mark.parametrize("flags", [["--host", "10.0.0.5"], ["--ray-address", "10.0.0.1:6379"]])
def test_serve_exits_2_naming_ray_auth_mode(flags, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(SystemExit) as exit_:
        brigade(["serve", *flags, "--check"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("error: ") and "RAY_AUTH_MODE=token" in err
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert brigade(["serve", *flags, "--check"]) == 0
