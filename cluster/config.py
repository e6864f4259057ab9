"""The cluster's configuration: one YAML file with the same fields as the flags."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.parallel_config import WorkerParallelism
from engine import CacheConfig, EngineConfig, SchedulerConfig
from engine.config import HiCacheConfig
from kv_transfer import TransferConfig
from kv_transfer.config import is_wildcard
from router.config import FrontDoorConfig, IndexConfig, RouterConfig


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SupervisorConfig(_Frozen):
    """Replacing workers that stay unhealthy (cluster/supervisor.py; `brigade serve` only)."""

    enabled: bool = True
    grace_s: float = Field(10.0, gt=0)  # unhealthy this long (by the router's checks) before it is replaced
    interval_s: float = Field(1.0, gt=0)
    status_timeout_s: float = Field(10.0, gt=0)


class WorkerEngine(_Frozen):
    """Engine settings every worker shares (each worker gets its own pool of this size)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    quantization: Literal["none", "int8", "gguf"] = "none"
    device: str = "auto"
    block_size: int = Field(16, ge=1)
    num_blocks: int | None = Field(None, ge=2)
    max_num_batched_tokens: int = Field(2048, ge=16)
    max_num_seqs: int = Field(128, ge=1)
    max_model_len: int | None = Field(None, ge=1)
    # Host-memory and disk tiers under each prefill (or mixed) worker's pool; disk_dir gets one
    # subdirectory per worker, named by its id, so a restarted worker re-indexes its own files.
    hicache: HiCacheConfig = HiCacheConfig()


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
    ray_address: str | None = None
    redis_url: str | None = None
    # The NAME of an env var holding Redis's password (e.g. set from a Kubernetes Secret), so the
    # password need not be written into redis_url; it is never printed.
    redis_password_env: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    host: str = "127.0.0.1"
    http_port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(50051, ge=0, le=65535)  # None: no gRPC front door
    num_cpus: float | None = Field(None, gt=0)  # CPU cores the workers share; default: all
    engine: WorkerEngine = WorkerEngine()
    router: RouterConfig = RouterConfig()
    index: IndexConfig = IndexConfig()
    frontdoor: FrontDoorConfig = FrontDoorConfig()
    transfer: TransferConfig = TransferConfig()
    parallel: WorkerParallelism = WorkerParallelism()
    supervisor: SupervisorConfig = SupervisorConfig()
    placement: RayPlacement = RayPlacement()

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if self.mode == "disaggregated" and self.prefill < 1:
            raise ValueError("disaggregated mode needs at least one prefill worker (--prefill >= 1)")
        if self.redis_password_env and self.redis_url is None:
            raise ValueError("redis_password_env needs redis_url (the embedded redis-server has no password)")
        if is_wildcard(self.host):
            raise ValueError("host must be a specific address (e.g. 127.0.0.1 or the pod IP), not a wildcard")
        cache_role = "mixed" if self.mode == "colocated" else "prefill"  # the workers whose tiers would hold KV
        if self.engine.hicache.enabled and self.parallel.ranks(cache_role) > 1:
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

    def engine_config(self, num_threads: int | None, worker_id: str | None = None) -> EngineConfig:
        e = self.engine
        cache = CacheConfig(block_size=e.block_size, num_blocks=e.num_blocks, hicache=self.worker_hicache(worker_id))
        return EngineConfig(
            model=self.model, dtype=e.dtype, quantization=e.quantization, device=e.device,
            max_model_len=e.max_model_len, num_threads=num_threads, cache=cache,
            scheduler=SchedulerConfig(max_num_batched_tokens=e.max_num_batched_tokens, max_num_seqs=e.max_num_seqs),
        )

    def worker_hicache(self, worker_id: str | None) -> HiCacheConfig:
        """A worker's own HiCache settings. Decode workers never match prefixes (their KV comes
        from a prefill worker), so tiers there would only cost copies: off."""
        hc = self.engine.hicache
        if not hc.enabled or worker_id is None:
            return hc
        if worker_id.startswith("decode-"):
            return HiCacheConfig()
        return hc.model_copy(update={"disk_dir": str(Path(hc.disk_dir) / worker_id)}) if hc.disk_dir else hc


def load_config(path: Path | str | None, overrides: dict) -> ClusterConfig:
    """The file's fields, then the flags that were given on top (None means not given).

    Overrides may be nested (`{"engine": {"num_blocks": 64}}`): a flag replaces one field of a
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
