"""The engine stays a plain library at run time too: importing every engine module in a fresh
interpreter loads no Ray, Redis or gRPC, directly or through a dependency (tests/unit/test_layering.py
checks the imports each file names)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE_PACKAGES = {"ray", "redis", "grpc"}

# Imports every engine module in a fresh interpreter and prints the top-level names of
# all modules then loaded. Files are found on disk rather than with pkgutil, which skips
# directories without __init__.py. assets/ holds package data, not code; __main__ would run.
_IMPORT_ALL = """
import importlib, json, pathlib, sys
root = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(root))
for path in sorted((root / "engine").rglob("*.py")):
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    if "assets" in parts or parts[-1] == "__main__" or not all(p.isidentifier() for p in parts):
        continue
    importlib.import_module(".".join(parts))
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})))
"""


def test_engine_modules_load_no_service_package_at_run_time() -> None:
    """Everything that got loaded, transitively."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "engine" in loaded
    assert loaded & SERVICE_PACKAGES == set()
