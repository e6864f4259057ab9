"""The device check's --cpu-smoke mode: every section of benchmarks/_gpu_check.py runs on
CPU (tiny shapes) and writes its JSON, so the check is ready when a GPU machine is lent."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTIONS = {"gpu_tests", "sdpa_probe", "collective_wait", "transfer_rates", "engine_shapes", "engine_preset"}


def test_cpu_smoke_runs_every_section(tmp_path):
    env = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable}
    proc = subprocess.run([str(ROOT / "benchmarks" / "gpu_check.sh"), "--cpu-smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["errors"] == {}
    assert set(report["raw"]) == SECTIONS
    assert report["machine"]["smoke"] is True and report["machine"]["device"] == "cpu"
    s = report["raw"]
    assert s["gpu_tests"]["returncode"] == 0 and "collected" in s["gpu_tests"]["summary"]
    # The packed path's metadata agrees with the reference on every probe case.
    assert set(s["sdpa_probe"]) == {"decodes", "chunk_with_history", "prefix_hit", "mixed"}
    assert report["ratios"]["varlen_max_rel_err"] <= 1e-5
    assert s["collective_wait"]["backend"] == "gloo" and s["collective_wait"]["calls"] > 0
    for shape in ("qwen3-0.6b", "llama-3-8b"):
        runs = s["engine_shapes"][shape]
        assert {r["attention"] for r in runs.values()} == {"sdpa_varlen", "reference"}
        assert all(r["tokens_per_s"] > 0 and r["aten_ops_per_step"] > 0 for r in runs.values())


def test_without_cuda_the_full_check_says_what_to_do(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks._gpu_check", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 2 and "--cpu-smoke" in proc.stderr
    assert not (tmp_path / "gpu_check.json").exists()
