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
def brigade_serve(flags: list[str], log: Path, timeout_s: float = 180.0) -> Iterator[Served]:
    """Start `brigade serve FLAGS`, wait for its ready line, and stop it with SIGTERM after."""
    from engine.presets import materialize

    materialize("tiny")  # once here, rather than raced by the server and a reference engine
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *flags], cwd=ROOT,
                                env={**os.environ, **RAY_ENV}, stdout=subprocess.PIPE, stderr=err, text=True)
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
