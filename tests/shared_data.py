"""The project's shared data (../shared/data/ beside the repository: the Mooncake trace, the
KubeRay CRDs). A test that needs a file skips, naming it, where the folder is not there."""
from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def shared_data(name: str) -> Path:
    path = SHARED_DATA / name
    if not path.exists():
        pytest.skip(f"needs {path} (../shared/data/{name} beside the repository; see its README)")
    return path
