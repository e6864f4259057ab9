"""A served fleet: a real `brigade serve` in a subprocess, as a context that starts it, waits for
its ready line and stops it with SIGTERM (serve drains and stops what it started). The tests that
drive the product from outside (tests/serve_process.py) and the benchmarks that measure a served
fleet use this one; both import it from the repository root."""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Ray: no usage reporting, no token auth (a real deployment distributes the token).
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
READY = "Brigade serving"  # "Brigade serving MODEL at http://HOST:PORT/v1 and grpc://HOST:PORT ..."
# ray.init inside serve now and then fails to bootstrap its own daemons on a loaded small machine
# (the GCS writes no port file or answers no "node info" in time; the dashboard process aborts).
# serve then exits 1 saying so, as it should; the served fleet starts it once more rather than fail
# on Ray's start.
RAY_BOOTSTRAP_FAILURES = ("Failed to get node info", "Failed to start the dashboard",
                          "Timed out waiting for file")


class ServeFailed(RuntimeError):
    """`brigade serve` exited, or printed no ready line in time; the message ends with its log."""


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


def stdout_path(log: Path) -> Path:
    """Where serve's stdout goes beside its stderr log `log` (a file, so nothing blocks on a full pipe)."""
    return log.with_name(log.name + ".out")


def start(flags: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`brigade serve FLAGS` (with `env` added to ours), stderr to `log`, stdout to stdout_path(log)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as err, stdout_path(log).open("w") as out:
        return subprocess.Popen([sys.executable, "-m", "cluster.cli", "serve", *flags], cwd=ROOT,
                                env={**os.environ, **RAY_ENV, **(env or {})}, stdout=out, stderr=err, text=True)


def ready_lines(proc: subprocess.Popen, log: Path, timeout_s: float) -> list[str] | None:
    """serve's stdout up to its ready line; None if it exited first or printed none within
    `timeout_s` (then it is stopped)."""
    deadline = time.monotonic() + timeout_s
    path = stdout_path(log)
    while True:
        lines = path.read_text().splitlines(keepends=True) if path.exists() else []
        at = next((i for i, line in enumerate(lines) if line.startswith(READY) and line.endswith("\n")), None)
        if at is not None:
            return lines[:at + 1]
        if proc.poll() is not None:
            return None
        if time.monotonic() > deadline:
            stop(proc)
            return None
        time.sleep(0.1)


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """SIGTERM (serve drains and stops what it started), SIGKILL if that takes over `grace_s`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def served_fleet(flags: list[str], log: Path, timeout_s: float = 180.0,
                 env: dict[str, str] | None = None) -> Iterator[Served]:
    """`brigade serve FLAGS` until its ready line (once more if Ray's own start failed), stopped
    with SIGTERM after. ServeFailed, ending with the log, if it never became ready."""
    for attempt in (1, 2):
        proc = start(flags, log, env)
        out = ready_lines(proc, log, timeout_s)
        if out is not None:
            break
        text = log.read_text()
        if attempt == 2 or not any(f in text for f in RAY_BOOTSTRAP_FAILURES):
            raise ServeFailed(f"brigade serve {' '.join(flags)}: no ready line within {timeout_s:g} s "
                              f"(exit code {proc.poll()}); its log {log}:\n{text[-3000:]}")
        log.rename(log.with_suffix(".first-attempt.log"))
    try:
        yield Served(proc, log, out)
    finally:
        stop(proc)
