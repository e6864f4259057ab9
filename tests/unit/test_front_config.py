"""An extra front (`brigade serve --front-only`, config `role: front`): it needs the cluster it
joins and the owner's Redis, and says so before anything starts; the worker names it discovers."""
from __future__ import annotations

import pytest

from cluster.cli import main as brigade
from cluster.config import ClusterConfig, load_config


@pytest.mark.parametrize("flags", [[], ["--ray-address", "10.0.0.1:6379"], ["--redis-url", "redis://10.0.0.2:6379/0"]])
def test_a_front_without_a_cluster_or_the_shared_redis_exits_2(flags, monkeypatch, capsys) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    with pytest.raises(SystemExit) as exit_:
        brigade(["serve", "--front-only", *flags, "--check"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "role front (--front-only)" in err and "--ray-address" in err, err


def test_a_front_with_both_checks_and_the_file_says_the_same(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert brigade(["serve", "--front-only", "--ray-address", "10.0.0.1:6379", "--redis-url",
                    "redis://10.0.0.2:6379/0", "--check"]) == 0
    path = tmp_path / "front.yaml"
    path.write_text("role: front\nray_address: 10.0.0.1:6379\nredis_url: redis://10.0.0.2:6379/0\n")
    assert load_config(path, {}).role == "front"
    assert ClusterConfig().role == "owner"


def test_only_the_owners_worker_ids_are_discovered() -> None:
    from cluster.front import WORKER_NAME

    names = ["prefill-0", "decode-12", "mixed-3", "decode-0-rank1", "decode-0-group", "router", "prefill-x"]
    assert [n for n in names if WORKER_NAME.match(n)] == ["prefill-0", "decode-12", "mixed-3"]
