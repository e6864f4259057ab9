"""Chaos: `brigade serve` notices when a part it started dies (cluster/watchdog.py), against a real
`brigade serve` (`tiny` preset, 1 prefill + 1 decode, local Ray, embedded redis-server).

- The embedded redis-server SIGKILLed: not fatal. It is started again on the same port and
  requests keep being served.
- The router actor's process, or a local Ray daemon (raylet; with BRIGADE_CHAOS_FULL=1 the GCS
  too), SIGKILLed: serve says what died and what to do, exits 3, and leaves no process behind.
"""
from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import psutil
import pytest
from serve_process import Served, brigade_serve, find_process, serve_processes
from support import wait_for

from cluster.watchdog import EXIT_FAILED

FULL = os.environ.get("BRIGADE_CHAOS_FULL") == "1"
FLAGS = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "128"]
PROMPT = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
EXIT_DEADLINE_S = 60.0


def complete(base: str) -> dict:
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(PROMPT).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_exits_failed(served: Served, victim: psutil.Process, says: str, chaos_figure, name: str) -> None:
    procs = serve_processes(served)
    start = time.monotonic()
    victim.send_signal(signal.SIGKILL)
    code = served.proc.wait(EXIT_DEADLINE_S)
    seconds = time.monotonic() - start
    log = served.log.read_text()
    print(f"\n{name}: exit code {code} {seconds:.1f} s after the kill")
    chaos_figure(name, raw_exit_code=code, seconds_to_exit=seconds)
    assert code == EXIT_FAILED, log[-3000:]
    assert says in log and "start `brigade serve` again" in log and f"exit code {EXIT_FAILED}" in log, log[-3000:]
    wait_for(lambda: all(gone(p) for p in procs), 15,
             lambda: f"every process gone; left: {[' '.join(p.cmdline())[:80] for p in procs if not gone(p)]}", 0.2)


@pytest.mark.timeout(300)
def test_a_dead_redis_is_restarted_and_a_dead_router_ends_serve_with_exit_3(tmp_path: Path, chaos_figure) -> None:
    with brigade_serve(FLAGS, tmp_path / "serve.log") as served:
        before = complete(served.http_base)
        redis = find_process(served, "redis-server")
        redis_cmdline = redis.cmdline()  # names its port
        redis.send_signal(signal.SIGKILL)
        wait_for(lambda: "redis: embedded redis-server back on port" in served.log.read_text(), 30,
                 lambda: f"serve logging redis' restart; the log ends:\n{served.log.read_text()[-3000:]}")
        restarted = find_process(served, "redis-server")
        assert restarted.pid != redis.pid and restarted.cmdline() == redis_cmdline  # same port
        assert served.proc.poll() is None
        assert complete(served.http_base)["choices"][0]["text"] == before["choices"][0]["text"]

        assert_exits_failed(served, find_process(served, "ray::RouterActor"), "the router actor died",
                            chaos_figure, "serve_router_killed")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("daemon", ["raylet", "gcs_server"] if FULL else ["raylet"])
def test_a_dead_ray_daemon_ends_serve_with_exit_3(daemon: str, tmp_path: Path, chaos_figure) -> None:
    with brigade_serve(FLAGS, tmp_path / "serve.log") as served:
        complete(served.http_base)
        assert_exits_failed(served, find_process(served, daemon), f"Ray's {daemon}", chaos_figure,
                            f"serve_{daemon}_killed")
