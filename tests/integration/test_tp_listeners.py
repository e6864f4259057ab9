"""Nothing listens on a wildcard address with a tensor-parallel decode worker either:
its ranks' group store (a TCPStore, which alone would listen on every interface), their gloo
sockets and each rank's KV rendezvous all bind the one configured host. A real `brigade serve
--decode-tp 2`; every listening socket of the whole process tree is checked, Ray's included."""
from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import psutil
import pytest
from serve_process import Served, brigade_serve, serve_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

WILDCARDS = ("0.0.0.0", "::", "")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "128", "--decode-tp", "2"]
    with brigade_serve(flags, tmp_path_factory.mktemp("serve-tp") / "serve.log", timeout_s=300) as s:
        yield s


def test_nothing_listens_on_a_wildcard_with_decode_tp_2(served: Served) -> None:
    body = json.dumps({"prompt": [5, 17, 300, 2], "max_tokens": 3, "temperature": 0}).encode()
    request = urllib.request.Request(f"{served.http_base}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as resp:  # a real request over the TP pairs first
        assert resp.status == 200 and json.loads(resp.read())["usage"]["completion_tokens"] == 3
    listening, wild = 0, []
    for p in serve_processes(served):
        try:
            for c in p.net_connections(kind="inet"):
                if c.status == psutil.CONN_LISTEN:
                    listening += 1
                    if c.laddr.ip in WILDCARDS:
                        wild.append((" ".join(p.cmdline())[:80], c.laddr))
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    assert listening >= 8, listening  # the doors, Redis, Ray's daemons, the ranks' stores and pairs
    assert not wild, wild
