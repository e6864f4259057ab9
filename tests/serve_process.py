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


@contextlib.contextmanager
def brigade_serve(flags: list[str], log: Path, timeout_s: float = 180.0,
                  env: dict[str, str] | None = None) -> Iterator[Served]:
    """Start `brigade serve FLAGS` (with `env` added to ours), wait for its ready line, and stop it
    with SIGTERM after."""
    from engine.presets import materialize

    materialize("tiny")  # once here, rather than raced by the server and a reference engine
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *flags], cwd=ROOT,
                                env={**os.environ, **RAY_ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=err,
                                text=True)
    out: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not (out and out[-1].startswith("Brigade serving")):
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            line = proc.stdout.readline() if ready else ""
            assert line, f"no ready line within {timeout_s:g} s (exit code {proc.poll()}):\n{log.read_text()[-3000:]}"
            out.append(line)
        yield Served(proc, log, out)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        print(log.read_text()[-5000:], file=sys.stderr)  # pytest shows it on failure


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
