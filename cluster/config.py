"""The cluster's configuration: one YAML file with the same fields as the flags."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import Field, model_validator

from cluster.parallel_config import WorkerParallelism
from engine import EngineConfig, Role
from engine.config import Frozen as _Frozen
from engine.config import HiCacheConfig
from kv_transfer import TransferConfig
from kv_transfer.config import is_wildcard
from router.config import FrontDoorConfig, IndexConfig, RouterConfig

# EngineConfig fields each worker gets from worker_config, never from the file.
PER_WORKER = ("model", "role", "num_threads", "parallel")
PER_WORKER_HOW = {"role": "each worker's role follows --mode, --prefill and --decode",
                  "num_threads": "--num-cpus sets every worker's share",
                  "parallel": "use the top-level parallel section (prefill_tp, decode_tp, decode_ep)"}


class SupervisorConfig(_Frozen):
    """Replacing workers that stay unhealthy (cluster/supervisor.py; `brigade serve` only)."""

    enabled: bool = True
    grace_s: float = Field(10.0, gt=0)  # unhealthy this long (by the router's checks) before it is replaced
    interval_s: float = Field(1.0, gt=0)
    status_timeout_s: float = Field(10.0, gt=0)


class RayPlacement(_Frozen):
    """Ray custom resources every rank of a worker asks for, on top of its GPU (or CPU share).
    On KubeRay each worker group advertises its own (rayStartParams `resources`), so prefill
    and decode workers land on their own groups' pods and scale apart."""

    prefill: dict[str, float] = {}
    decode: dict[str, float] = {}  # decode workers, and mixed workers in colocated mode

    def resources(self, role: str) -> dict[str, float]:
        return dict(self.prefill if role == "prefill" else self.decode)


class ClusterConfig(_Frozen):
    model: str = "tiny"
    prefill: int = Field(1, ge=0)
    decode: int = Field(1, ge=1)  # in colocated mode: the number of mixed workers
    mode: Literal["disaggregated", "colocated"] = "disaggregated"
    # owner: this `brigade serve` starts and supervises the workers (and dies with them: Ray ties
    # actors to the driver that made them). front: it joins a cluster an owner serves (ray_address)
    # and adds its own doors and router over the owner's workers, found by their Ray actor names,
    # sharing the owner's Redis (redis_url); it starts no worker and may come and go (cluster/front.py).
    role: Literal["owner", "front"] = "owner"
    ray_address: str | None = None
    redis_url: str | None = None
    # The NAME of an env var holding Redis's password (e.g. set from a Kubernetes Secret), so the
    # password need not be written into redis_url; it is never printed.
    redis_password_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(50051, ge=0, le=65535)  # None: no gRPC front door
    num_cpus: float | None = Field(None, gt=0)  # CPU cores the workers share; default: all
    # How long a stop (SIGTERM/SIGINT) waits for requests in flight, on both doors at once (the
    # gRPC door gets 10 s more), before it stops the workers anyway. On Kubernetes keep it and
    # the preStop sleep inside terminationGracePeriodSeconds.
    drain_s: float = Field(30.0, gt=0)
    # Every worker's engine (each gets its own KV pool of this size); worker_config() finishes
    # it per worker. Its `model` is the top-level `model`, kept in one place.
    engine: EngineConfig = EngineConfig()
    router: RouterConfig = RouterConfig()
    index: IndexConfig = IndexConfig()
    frontdoor: FrontDoorConfig = FrontDoorConfig()
    transfer: TransferConfig = TransferConfig()
    parallel: WorkerParallelism = WorkerParallelism()
    supervisor: SupervisorConfig = SupervisorConfig()
    placement: RayPlacement = RayPlacement()

    @model_validator(mode="before")
    @classmethod
    def _one_model(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        model, engine = data.get("model", "tiny"), data.get("engine")
        if isinstance(engine, EngineConfig):
            return {**data, "engine": engine.model_copy(update={"model": model})}
        if engine is None or isinstance(engine, dict):
            if (engine or {}).get("model", model) != model:  # a printed config repeats it: fine
                raise ValueError("engine.model: set the top-level `model` (--model) instead")
            return {**data, "engine": {**(engine or {}), "model": model}}
        return data  # not a mapping: pydantic names the bad value

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.mode == "disaggregated" and self.prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill worker (--prefill >= 1)")
        for name in PER_WORKER[1:]:  # the model is the top-level one (_one_model)
            if getattr(self.engine, name) != EngineConfig.model_fields[name].default:
                raise ValueError(f"engine.{name} is set per worker (cluster.config.worker_config); "
                                 f"remove it from the config: {PER_WORKER_HOW[name]}")
        if self.redis_password_env and self.redis_url is None:
            raise ValueError("redis_password_env needs redis_url (the embedded redis-server makes its own password)")
        if self.role == "front" and (self.ray_address is None or self.redis_url is None):
            raise ValueError("role front (--front-only) joins a cluster another `brigade serve` owns: it needs "
                             "--ray-address and that server's --redis-url (the shared prefix index)")
        if is_wildcard(self.host):
            raise ValueError("host must be a specific address (e.g. 127.0.0.1 or the pod IP), not a wildcard")
        cache_role = "mixed" if self.mode == "colocated" else "prefill"  # the workers whose tiers would hold KV
        if self.engine.cache.hicache.enabled and self.parallel.ranks(cache_role) > 1:
            # Each rank holds only its KV heads; the tiers copy one rank's pool. Until every rank
            # keeps its own tiers in step, the two do not mix.
            raise ValueError(f"HiCache is not supported on multi-rank {cache_role} workers yet; "
                             "turn off --hicache or use TP/EP 1 there")
        return self

    @property
    def num_prefill(self) -> int:
        return 0 if self.mode == "colocated" else self.prefill

    @property
    def num_ranks(self) -> int:
        """Processes all workers take together (a TP/EP worker is one per rank)."""
        return self.num_prefill * self.parallel.ranks("prefill") + self.decode * self.parallel.ranks("decode")


def worker_config(cfg: ClusterConfig, role: Role, worker_id: str, num_threads: int | None,
                  publishes_events: bool = False) -> EngineConfig:
    """The one place a worker's engine config is finished from the root config: its role, its
    torch threads, its HiCache (decode workers never match prefixes, so none there: tiers would
    only cost copies; a disk tier gets one subdirectory per worker id, so a restarted worker
    re-indexes its own files), and its cache event log when it publishes to the index."""
    hc = cfg.engine.cache.hicache
    if hc.enabled and role == Role.DECODE:
        hc = HiCacheConfig()
    elif hc.enabled and hc.disk_dir:
        hc = hc.model_copy(update={"disk_dir": str(Path(hc.disk_dir) / worker_id)})
    cache = cfg.engine.cache.model_copy(update={"hicache": hc, "record_events": publishes_events})
    return cfg.engine.model_copy(update={"role": role, "num_threads": num_threads, "cache": cache})


def load_config(path: Path | str | None, overrides: dict) -> ClusterConfig:
    """The file's fields, then the flags that were given on top (None means not given).

    Overrides may be nested (`{"engine": {"cache": {"num_blocks": 64}}}`): a flag replaces one field of a
    section, never the whole section from the file. Raises ValueError (a bad file) or
    pydantic's ValidationError (a bad field: unknown keys included, `extra="forbid"`).
    """
    data: dict = {}
    if path is not None:
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ValueError(f"{path}: a cluster config must be a YAML mapping of fields")
        data = loaded or {}
    return ClusterConfig.model_validate(_merge(data, overrides))


def _merge(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict):
            if out.get(key) is None or isinstance(out[key], dict):  # else keep the file's bad value to report
                out[key] = _merge(out.get(key) or {}, value)
        elif value is not None:
            out[key] = value
    return out


def redis_url_with_password(url: str, password_env: str | None) -> str:
    """`url` with the password from the env var named `password_env` put in (URL-quoted).
    ValueError naming the variable if it is unset or empty, or if the URL has a password already."""
    if password_env is None:
        return url
    password = os.environ.get(password_env, "")
    if not password:
        raise ValueError(f"redis_password_env names ${password_env}, which is unset or empty; "
                         f"export {password_env} (e.g. from a Secret) or unset redis_password_env")
    parts = urlsplit(url)
    if parts.password is not None:
        raise ValueError("redis_url has a password and redis_password_env is set too; keep one")
    user = quote(parts.username or "", safe="")
    netloc = f"{user}:{quote(password, safe='')}@{parts.netloc.rpartition('@')[2]}"
    return urlunsplit(parts._replace(netloc=netloc))


def cpu_budget(cfg: ClusterConfig) -> float:
    return cfg.num_cpus or float(os.cpu_count() or 1)
