"""The chaos suite's figures.

`chaos_figure` records a test's figure; with BRIGADE_CHAOS_FULL=1 the session writes them all to
benchmarks/results/chaos.json in the benchmarks' shape, merged into what earlier full runs wrote
(so running one chaos test again updates only its own figure). CI runs (reduced counts) write nothing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from support import FULL  # tests/ is on the path (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]


class ChaosFigures:
    def __init__(self):
        self.ratios: dict[str, float] = {}
        self.targets: dict[str, str] = {}
        self.raw: dict[str, dict[str, Any]] = {}

    def __call__(self, name: str, ratios: dict[str, float] | None = None, targets: dict[str, str] | None = None,
                 **values: Any) -> None:
        """Record test `name`'s figure: `values` go to raw[name]; ratios/targets keys get a `name.` prefix."""
        self.raw[name] = values
        self.ratios.update({f"{name}.{k}": v for k, v in (ratios or {}).items()})
        self.targets.update({f"{name}.{k}": v for k, v in (targets or {}).items()})

    def write(self) -> Path:
        from benchmarks import _common as C

        path = C.result_path("chaos")
        old = json.loads(path.read_text()) if path.exists() else {"ratios": {}, "targets": {}, "raw": {}}
        return C.write_result("chaos", C.machine_info(chaos_full=True),
                              old["ratios"] | self.ratios, old["targets"] | self.targets, old["raw"] | self.raw)


@pytest.fixture(scope="session")
def chaos_figures():
    figures = ChaosFigures()
    yield figures
    if FULL and figures.raw:
        print(f"\nchaos figures written to {figures.write()}")


@pytest.fixture
def chaos_figure(chaos_figures) -> ChaosFigures:
    return chaos_figures
