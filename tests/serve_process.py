"""A real `brigade serve` in a subprocess, for the tests that drive it from outside: the served
fleet of benchmarks.harness.served with the tests' defaults (float32 weights, the tiny preset built
once up front, the log shown on failure), and what the tests look up inside it."""
from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

from benchmarks.harness.served import RAY_ENV, ROOT, Served, ready_lines, served_fleet, start, stop

__all__ = ["RAY_ENV", "ROOT", "Served", "brigade_serve", "door_in_flight", "find_process", "ray_address",
           "ready_lines", "serve_processes", "start", "stop"]


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
    try:
        with served_fleet(flags, log, timeout_s, env) as served:
            yield served
    finally:
        if log.exists():
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


@contextlib.contextmanager
def ray_driver(served: Served) -> Iterator[None]:
    """This process joined to the Ray cluster `served` started, as a driver in Brigade's namespace
    (to reach its named worker actors), left again after."""
    import ray

    from cluster.launch import NAMESPACE, _keep_ray_on_loopback

    _keep_ray_on_loopback()  # join as a driver on 127.0.0.1, where its raylet is
    ray.init(address=ray_address(served), namespace=NAMESPACE, _node_ip_address="127.0.0.1")
    try:
        yield
    finally:
        ray.shutdown()
