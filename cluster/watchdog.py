"""What `brigade serve` watches while it serves: the parts it started. A loss the cluster cannot
work without ends `serve` with EXIT_FAILED and a message saying what died and what to do; a loss
it survives is repaired here, or by the router and the supervisor.

- The router actor: fatal. Every request passes through it and nothing restarts it.
- A local Ray's GCS or raylet (not when joining a cluster with --ray-address): fatal. The router
  and the workers die with the raylet; without the GCS nothing can be placed or replaced.
- The embedded redis-server: not fatal. Redis holds hints only (the prefix index, the worker
  leases): while it is gone requests are routed by load alone, then the index rebuilds. It is
  started again on the same port, so every client reconnects to it.
- A worker: not fatal. The router stops routing to it, the supervisor replaces it.
"""
from __future__ import annotations

import sys

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError

EXIT_FAILED = 3  # `brigade serve` stopped because a part it cannot serve without died
FATAL_RAY_PROCESSES = ("gcs_server", "raylet")  # ray._private.ray_constants.PROCESS_TYPE_*
ROUTER_TIMEOUT_S = 10.0  # a busy router answers slowly; only a dead one is fatal


def descendants() -> list[psutil.Process]:
    """Every process under this one, now: taken before stopping after a failure, because Ray's
    agents outlive a dead raylet as orphans (no longer our children) that nothing else stops."""
    return psutil.Process().children(recursive=True)


def stop_leftovers(procs: list[psutil.Process], grace_s: float = 5.0) -> None:
    """SIGKILL whichever of `procs` is still running `grace_s` after the normal stop."""
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        try:
            print(f"stopping a leftover process: pid {p.pid} {p.name()}", file=sys.stderr, flush=True)
            p.kill()  # psutil checks the pid was not reused
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace_s)


class Watchdog:
    def __init__(self, services, local_ray: bool):
        """`services`: cluster.serve._Services, once started; `local_ray`: serve started Ray itself."""
        self.services, self.local_ray = services, local_ray
        self._redis_failed = False  # a failed restart is reported once, retried at every check

    def check(self) -> str | None:
        """None while serving can go on; else what died and what to do, for the operator."""
        return self._ray() or self._router() or self._redis()

    def _ray(self) -> str | None:
        node = ray._private.worker._global_node if self.local_ray else None
        if node is None:
            return None
        for kind, proc in node.dead_processes():
            if kind in FATAL_RAY_PROCESSES:
                return (f"Ray's {kind} (pid {proc.pid}) exited with code {proc.returncode}: the router and the "
                        f"workers cannot run without it. Its log is under {node.get_logs_dir_path()}; "
                        "start `brigade serve` again")
        return None

    def _router(self) -> str | None:
        try:
            ray.get(self.services.cluster.router.status.remote(), timeout=ROUTER_TIMEOUT_S)
        except RayActorError as exc:
            return (f"the router actor died ({type(exc).__name__}): every request passes through it and it is "
                    "not restarted. The Ray worker logs (raylet.out, worker-*.err) say why; "
                    "start `brigade serve` again")
        except GetTimeoutError:
            print(f"the router did not answer a status call within {ROUTER_TIMEOUT_S:g} s", file=sys.stderr,
                  flush=True)
        return None

    def _redis(self) -> None:
        redis = self.services.redis
        if redis is None or redis.proc is None or redis.proc.poll() is None:
            return None
        if not self._redis_failed:
            print(f"the embedded redis-server exited with code {redis.proc.returncode}: routing by load alone "
                  f"until it is back; starting it again on port {redis.port}", file=sys.stderr, flush=True)
        try:
            redis.restart()
        except Exception as exc:  # Redis only holds hints: keep serving, try again at the next check
            if not self._redis_failed:
                print(f"starting redis-server again failed ({exc}); retrying", file=sys.stderr, flush=True)
            self._redis_failed = True
            return None
        print(f"redis: embedded redis-server back on port {redis.port}", file=sys.stderr, flush=True)
        self._redis_failed = False
        return None
