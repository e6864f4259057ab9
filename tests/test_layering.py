"""The engine stays a plain library: no Ray, Redis or gRPC, and no pickle (DESIGN.md).

Both checks walk whatever modules exist under engine/, so they need no update as it grows.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE = ROOT / "engine"

SERVICE_PACKAGES = {"ray", "redis", "grpc"}
# Import roots the engine may not name at all; grpc_health/grpc_reflection are
# separate top-level modules of the gRPC add-on distributions.
FORBIDDEN_IMPORTS = SERVICE_PACKAGES | {
    "grpc_health", "grpc_reflection", "pickle", "_pickle", "cloudpickle", "dill",
}

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


def _engine_files() -> list[Path]:
    return sorted(ENGINE.rglob("*.py"))


def test_engine_modules_import_no_service_packages() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _IMPORT_ALL, str(ROOT)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "engine" in loaded
    assert loaded & SERVICE_PACKAGES == set()


def _imported_roots(tree: ast.AST) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.partition(".")[0])
    return roots


def test_engine_source_names_no_forbidden_imports() -> None:
    files = _engine_files()
    assert files, "engine/ has no Python files"
    offenders = {}
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        bad = _imported_roots(tree) & FORBIDDEN_IMPORTS
        if bad:
            offenders[str(path.relative_to(ROOT))] = sorted(bad)
    assert offenders == {}
