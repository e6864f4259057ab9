"""Shared test setup: a private preset cache, and GPU tests skipped cleanly without CUDA."""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest


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
