"""The shared data beside the repository (../shared/data/, read-only; see its README)."""
from __future__ import annotations

from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def shared_data(name: str) -> Path:
    """../shared/data/NAME relative to the repository root; skips the test, naming the path, if missing."""
    path = REPO_ROOT.parent / "shared" / "data" / name
    if not path.exists():
        pytest.skip(f"needs ../shared/data/{name} (see the shared data README)")
    return path
