"""A real multi-node Ray cluster on this one machine: a head and worker nodes, each `ray start
--block` process its own raylet, object store and agents, each on its own loopback address
with its own custom resources (standing for its GPUs or its role), all with Ray token auth on,
as a real deployment runs (cluster/ray_auth.py).

Why 127.0.19.x and not 127.0.0.1-3: Ray treats 127.0.0.1 (and "localhost") specially. In
cluster mode it rewrites them to the machine's routable address (ray._private.services.
resolve_ip_for_localhost), and the one way to keep them (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
refuses worker nodes. Every other address of 127.0.0.0/8 is local and kept as given; the
19 keeps this suite's nodes apart from anything else on the machine.

A node is lost as a machine is: SIGKILL to its raylet, its agents and every worker process on
it at once (`RayNode.kill`), never `ray stop` (which stops every Ray on the machine).
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from unittest.mock import patch

import psutil

RAY_BOOTSTRAP_FAILURES = ("timed out during startup", "Failed to get node info", "Timed out waiting for file")
RAY = str(Path(sys.executable).with_name("ray"))
HEAD_IP = "127.0.19.1"
OBJECT_STORE_BYTES = 80 << 20  # Ray's minimum is 75 MiB; KV moves over torch.distributed
# The GCS's node failure detector: a node missing 2 checks 1 s apart is dead (Ray's default
# takes tens of seconds). The router's own health checks eject a worker on its first failed
# call; this bounds how long a call to a dead node's actor waits to fail.
HEAD_SYSTEM_CONFIG = {"health_check_period_ms": 1000, "health_check_failure_threshold": 2,
                      "health_check_timeout_ms": 1000}


@functools.cache
def process_token() -> str:
    """One Ray auth token for every cluster this process makes: Ray's C++ client loads the token
    once per process (AuthenticationTokenLoader) and keeps it, so a second cluster under another
    token would refuse this process's GCS clients."""
    return secrets.token_hex(24)


def free_port(ip: str, lo: int = 19000, hi: int = 19999) -> int:
    """A port in [lo, hi] nothing listens on at `ip` now (bound and let go)."""
    for port in range(lo, hi + 1):
        with socket.socket() as s:
            try:
                s.bind((ip, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {lo}-{hi} on {ip}")


@dataclass
class RayNode:
    ip: str
    resources: dict[str, float]
    proc: subprocess.Popen
    log: Path
    head: bool = False

    def processes(self) -> list[psutil.Process]:
        """`ray start` and everything under it, plus anything left in its session (Ray's agents
        and workers can outlive their parent as orphans)."""
        try:
            root = psutil.Process(self.proc.pid)
            found = {root, *root.children(recursive=True)}
        except psutil.NoSuchProcess:
            found = set()
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(p.pid) == self.proc.pid:
                    found.add(p)
        return list(found)

    def actor_titles(self) -> list[str]:
        """The Ray actor processes on this node by class ("PrefillActor", "DecodeActor", ...)."""
        out = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                words = " ".join(p.cmdline()).split()
                if words and words[0].startswith("ray::") and "Agent" not in words[0] and words[0] != "ray::IDLE":
                    out.append(words[0].removeprefix("ray::").split(".")[0])
        return sorted(out)

    def kill(self) -> float:
        """Lose the node: SIGKILL to every process of it at once. Returns when it happened (monotonic)."""
        procs = self.processes()
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGKILL)
        at = time.monotonic()
        psutil.wait_procs(procs, timeout=30)
        self.proc.wait(30)
        return at

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class RayNodes:
    """The cluster: `head` first, then `add(ip, resources)` per worker node; `stop()` kills all."""

    tmp: Path
    token: str = field(default_factory=process_token)
    nodes: list[RayNode] = field(default_factory=list)
    gcs_port: int = 0

    @property
    def address(self) -> str:
        return f"{HEAD_IP}:{self.gcs_port}"

    @property
    def env(self) -> dict[str, str]:
        """What every process of the cluster (nodes, drivers) needs: token auth on, its token, and
        multi-node clusters allowed. The last is Ray's own default on Linux, but a local Ray
        started earlier in this pytest process (cluster.launch._keep_ray_on_loopback, under every
        ray_cluster module) set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 in its environment, and a
        `ray start --address` inheriting that refuses to join ("Multi-node Ray clusters are not
        supported on Windows and OSX")."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token, "RAY_USAGE_STATS_ENABLED": "0",
                "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"}

    @contextlib.contextmanager
    def client(self) -> Iterator[None]:
        """This process as a client of the cluster (GcsClient, ray.init): its token env, and Ray's
        per-process auth state reloaded from it on the way in and out. Ray reads RAY_AUTH_MODE
        into RayConfig and caches the token once per process, so after a local Ray with auth
        disabled earlier in the same pytest process (every ray_cluster module) this process would
        otherwise call the cluster without a token and every call would be refused."""
        from ray._private.authentication_test_utils import reset_auth_token_state

        try:
            with patch.dict(os.environ, self.env):
                reset_auth_token_state()
                yield
        finally:
            reset_auth_token_state()  # back to this process's own env (a local Ray's, auth disabled)

    def start_head(self, resources: dict[str, float] | None = None, num_cpus: int = 0) -> RayNode:
        self.gcs_port = free_port(HEAD_IP)
        return self._start(HEAD_IP, resources or {}, num_cpus, [
            "--head", "--port", str(self.gcs_port), "--include-dashboard", "false",
            "--ray-client-server-port", str(free_port(HEAD_IP, self.gcs_port + 1)),
            "--system-config", json.dumps(HEAD_SYSTEM_CONFIG)])

    def add(self, ip: str, resources: dict[str, float], num_cpus: int = 4) -> RayNode:
        """A worker node at `ip` (e.g. 127.0.19.2) joining the head; returns once Ray lists it alive."""
        return self._start(ip, resources, num_cpus, ["--address", self.address])

    def _start(self, ip: str, resources: dict[str, float], num_cpus: int, flags: list[str]) -> RayNode:
        log = self.tmp / f"ray-node-{ip}-{len(self.nodes)}.log"
        # Worker processes take ports from a range of their own per node start, inside 19000-19999.
        lo = 19100 + 100 * (len(self.nodes) % 9)
        cmd = [RAY, "start", "--block", "--node-ip-address", ip, "--num-cpus", str(num_cpus),
               "--resources", json.dumps(resources), "--object-store-memory", str(OBJECT_STORE_BYTES),
               "--min-worker-port", str(lo), "--max-worker-port", str(lo + 99), "--disable-usage-stats", *flags]
        for attempt in (1, 2):
            with log.open("w") as out:  # its own session: kill() finds every process of the node by it
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                        env={**os.environ, **self.env})
            node = RayNode(ip, resources, proc, log, head="--head" in flags)
            self.nodes.append(node)
            try:
                self.wait_alive(ip, node)
                return node
            except RuntimeError:
                # On a loaded machine Ray's own bootstrap now and then misses its fixed waits (as
                # benchmarks.harness.served.RAY_BOOTSTRAP_FAILURES): stop what it started, once more.
                text = log.read_text()
                if attempt == 2 or not any(f in text for f in RAY_BOOTSTRAP_FAILURES):
                    raise
                node.kill()
                self.nodes.remove(node)
                log.rename(log.with_suffix(".first-attempt.log"))
        raise AssertionError("unreachable")

    def wait_alive(self, ip: str, node: RayNode, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.is_alive(ip):
            if not node.alive:
                raise RuntimeError(f"ray start for {ip} exited {node.proc.returncode}:\n{node.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {ip} not alive within {timeout_s:g} s:\n{node.log.read_text()[-3000:]}")
            time.sleep(0.5)

    def is_alive(self, ip: str) -> bool:
        """The GCS lists an alive node at `ip` (`ray list`-free: the GCS's own node table)."""
        return any(n["ip"] == ip and n["alive"] for n in self.node_table())

    def node_table(self) -> list[dict]:
        """[{ip, alive, resources}] as the GCS has it; [] while the head does not answer."""
        if not self.gcs_port or not any(n.head and n.alive for n in self.nodes):
            return []
        from ray._raylet import GcsClient

        with contextlib.suppress(Exception):
            client = GcsClient(address=self.address)
            return [{"ip": n.node_manager_address, "alive": n.state == 0, "id": n.node_id.hex(),
                     "resources": dict(n.resources_total)} for n in client.get_all_node_info(timeout=5).values()]
        return []

    def node(self, ip: str) -> RayNode:
        """The live process of the node at `ip` (the latest one, after a restart)."""
        return [n for n in self.nodes if n.ip == ip][-1]

    def restart(self, ip: str, num_cpus: int = 4) -> RayNode:
        """The node at `ip` comes back (a fresh raylet with the same resources)."""
        old = self.node(ip)
        return self.add(ip, old.resources, num_cpus)

    def stop(self) -> None:
        for node in reversed(self.nodes):  # workers first, then the head
            if node.alive or node.processes():
                node.kill()
