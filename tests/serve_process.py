"""A real `brigade serve` in a subprocess, for the tests that drive it from outside."""
from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@dataclass
class Served:
    proc: subprocess.Popen
    log: Path  # its stderr
    out: list[str]  # its stdout lines up to the ready line

    @property
    def http_base(self) -> str:  # http://HOST:PORT, from "Brigade serving MODEL at http://HOST:PORT/v1 ..."
        return self.out[-1].split(" at ")[1].split()[0].removesuffix("/v1")

    @property
    def grpc_target(self) -> str:  # HOST:PORT, from "... and grpc://HOST:PORT ..."
        return self.out[-1].split("grpc://")[1].split()[0]


# ray.init inside serve now and then fails to bootstrap its own daemons on a loaded 2-core
# machine (the GCS writes no port file or answers no "node info" in time; the dashboard
# process aborts). serve then exits 1 saying so, as it should; the tests start it once more
# rather than fail on Ray's start.
RAY_BOOTSTRAP_FAILURES = ("Failed to get node info", "Failed to start the dashboard",
                          "Timed out waiting for file")


@contextlib.contextmanager
def brigade_serve(flags: list[str], log: Path, timeout_s: float = 180.0,
                  env: dict[str, str] | None = None) -> Iterator[Served]:
    """Start `brigade serve FLAGS` (with `env` added to ours), wait for its ready line, and stop it
    with SIGTERM after. Its weights are float32 unless FLAGS name --dtype: the tests compare its
    tokens against float32 references (`auto` picks bfloat16 on CPUs with bfloat16 instructions)."""
    from engine.presets import materialize

    if not any(f == "--dtype" or f.startswith("--dtype=") for f in flags):
        flags = [*flags, "--dtype", "float32"]

    materialize("tiny")  # once here, rather than raced by the server and a reference engine
    for attempt in (1, 2):
        with log.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *flags], cwd=ROOT,
                                    env={**os.environ, **RAY_ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=err,
                                    text=True)
        out = _ready_lines(proc, log, timeout_s)
        if out is not None:
            break
        text = log.read_text()
        assert attempt == 1 and any(f in text for f in RAY_BOOTSTRAP_FAILURES), (
            f"no ready line within {timeout_s:g} s (exit code {proc.poll()}):\n{text[-3000:]}")
        log.rename(log.with_suffix(".first-attempt.log"))
    try:
        yield Served(proc, log, out)
    finally:
        _stop(proc)
        print(log.read_text()[-5000:], file=sys.stderr)  # pytest shows it on failure


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (serve drains and stops what it started), SIGKILL if that takes over a minute."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _ready_lines(proc: subprocess.Popen, log: Path, timeout_s: float) -> list[str] | None:
    """serve's stdout up to its ready line; None if it exited first (stopped if it hangs)."""
    out: list[str] = []
    deadline = time.monotonic() + timeout_s
    while not (out and out[-1].startswith("Brigade serving")):
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        line = proc.stdout.readline() if ready else ""
        if not line:
            _stop(proc)
            return None
        out.append(line)
    return out


def serve_processes(served: Served) -> list:
    """The serve process and everything under it (Ray's daemons and workers, redis-server)."""
    import psutil

    root = psutil.Process(served.proc.pid)
    return [root, *root.children(recursive=True)]


def find_process(served: Served, name: str):
    """The one process under `served` called `name` (e.g. "raylet", "redis-server", or a Ray
    actor's title "ray::RouterActor")."""
    import psutil

    def title(p) -> str:  # a Ray worker's title is "ray::Class" or "ray::Class.method" while it runs one
        try:
            words = " ".join(p.cmdline()).split()
            return words[0].split(".")[0] if words and words[0].startswith("ray::") else p.name()
        except psutil.Error:  # exited (or a zombie) since the listing
            return ""

    found = [p for p in serve_processes(served) if title(p) == name]
    assert len(found) == 1, (name, found)
    return found[0]


def ray_address(served: Served) -> str:
    """The GCS address of the Ray that `served` started, from its raylet's command line."""
    raylet = find_process(served, "raylet")
    return next(a.split("=", 1)[1] for a in raylet.cmdline() if a.startswith("--gcs-address="))


def door_in_flight(server: Served) -> float:
    """The HTTP door's own count of requests it is still answering (its /metrics gauge): a
    request whose client left stays in it until the router confirmed the abort, a little after
    the router's own count (/health "running") is down."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{server.http_base}/metrics", timeout=60) as resp:
        text = resp.read().decode()
    return next((s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "brigade_requests_in_flight" and s.labels.get("door") == "http"), 0.0)
