"""The package table of ../shared/DESIGN.md, checked by AST: which of our packages each
package may import, the service libraries it may not, no cycle between packages, and file
sizes (soft 300 lines, hard 500). Every module under each package is walked (imports inside
functions count too), so the test needs no update as packages grow, and lists no exceptions.
(tests/integration/test_engine_imports.py checks what the engine loads at run time.)
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Our packages: top-level directory -> the import name (the client SDK installs as brigade_client).
PACKAGES = {"engine": "engine", "kv_transfer": "kv_transfer", "worker": "worker", "prefill_worker": "prefill_worker",
            "decode_worker": "decode_worker", "router": "router", "sim": "sim", "cluster": "cluster",
            "client/brigade_client": "brigade_client", "loadtest": "loadtest"}
OURS = set(PACKAGES.values())
# DESIGN.md's "may import" column, for our own packages. cluster/ is the composition root
# ("everything above"): it may import every package, and no package may import it.
MAY_IMPORT: dict[str, set[str]] = {
    "engine": set(),
    "kv_transfer": {"engine"},
    "worker": {"engine", "kv_transfer"},
    "prefill_worker": {"engine", "kv_transfer", "worker"},
    "decode_worker": {"engine", "kv_transfer", "worker"},
    "router": {"engine", "brigade_client"},
    "sim": {"engine", "router", "loadtest"},  # of loadtest only its trace rows and record (ONLY_MODULES)
    "cluster": OURS - {"cluster"},
    "brigade_client": set(),
    "loadtest": {"brigade_client"},
}
# Where a row allows a package only in part: these modules of it, no others. sim/ reuses
# loadtest's trace rows and per-request record (DESIGN.md's loadtest/ row), not the load generator.
ONLY_MODULES: dict[tuple[str, str], set[str]] = {("sim", "loadtest"): {"loadtest.records"}}
# The service libraries (and pickle) a package's row does not list.
RAY, REDIS, GRPC = {"ray"}, {"redis"}, {"grpc", "grpc_health", "grpc_reflection", "google"}
PICKLE = {"pickle", "_pickle", "cloudpickle", "dill"}
MAY_NOT_IMPORT: dict[str, set[str]] = {
    "engine": RAY | REDIS | GRPC | PICKLE,
    "kv_transfer": RAY | REDIS | GRPC | PICKLE,
    "worker": RAY | REDIS | GRPC | PICKLE,
    "prefill_worker": REDIS | GRPC | PICKLE,
    "decode_worker": REDIS | GRPC | PICKLE,
    "router": PICKLE,
    "sim": RAY | REDIS | GRPC | PICKLE,
    "cluster": PICKLE,
    "brigade_client": RAY | REDIS | PICKLE | {"torch"},
    "loadtest": RAY | REDIS | PICKLE | {"torch"},
}
GENERATED = ("_pb2.py", "_pb2_grpc.py")  # protoc output: sized by the .proto, not by us
SOFT_LINES, HARD_LINES = 300, 500



def modules(package_dir: str) -> Iterator[Path]:
    for path in sorted((ROOT / package_dir).rglob("*.py")):
        if "assets" not in path.relative_to(ROOT).parts:
            yield path


def imported_modules(path: Path) -> set[str]:
    """The absolute module names `path` imports (for `from M import x`: M, and M.x where x may be a module)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found


def imported_roots(path: Path) -> set[str]:
    return {name.partition(".")[0] for name in imported_modules(path)}


def edges() -> dict[str, dict[str, set[str]]]:
    """package -> imported root -> the files (relative paths) that import it."""
    out: dict[str, dict[str, set[str]]] = {}
    for directory, name in PACKAGES.items():
        found = out.setdefault(name, {})
        for path in modules(directory):
            for root in imported_roots(path) - {name}:
                found.setdefault(root, set()).add(str(path.relative_to(ROOT)))
    return out


def test_the_table_names_every_package_once() -> None:
    assert set(MAY_IMPORT) == set(MAY_NOT_IMPORT) == OURS
    present = {name for directory, name in PACKAGES.items() if (ROOT / directory).is_dir()}
    assert present >= OURS - {"sim"}, "a package of the table is missing"  # sim/ comes with the simulator


def test_packages_import_only_what_the_design_table_allows() -> None:
    found = edges()
    offenders = {f"{pkg} -> {dep}": sorted(files) for pkg, deps in found.items() for dep, files in deps.items()
                 if (dep in OURS and dep not in MAY_IMPORT[pkg]) or dep in MAY_NOT_IMPORT[pkg]}
    assert offenders == {}


def test_a_package_allowed_in_part_is_imported_only_there() -> None:
    offenders = {}
    for (pkg, dep), allowed in ONLY_MODULES.items():
        directory = next(d for d, name in PACKAGES.items() if name == pkg)
        for path in modules(directory):
            wrong = {m for m in imported_modules(path) if m.partition(".")[0] == dep and m not in allowed}
            if wrong:
                offenders[str(path.relative_to(ROOT))] = sorted(wrong)
    assert offenders == {}


def test_the_module_a_package_may_import_in_part_imports_no_more_of_its_own() -> None:
    """loadtest.records brings nothing of the load generator along (it imports no other loadtest module)."""
    for allowed in ONLY_MODULES.values():
        for module in allowed:
            path = ROOT / (module.replace(".", "/") + ".py")
            assert {m for m in imported_modules(path) if m.partition(".")[0] in OURS} == set(), module


def test_nothing_imports_the_composition_root() -> None:
    importers = {pkg for pkg, deps in edges().items() if "cluster" in deps}
    assert importers == set()


def test_no_cycle_between_packages() -> None:
    graph = {pkg: {d for d in deps if d in OURS} for pkg, deps in edges().items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path, node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, node])):
                return cycle
        state[node] = "done"
        return None

    cycles = [c for pkg in sorted(graph) if pkg not in state and (c := visit(pkg, []))]
    assert cycles == []


def _line_counts(directories) -> dict[str, int]:
    out = {}
    for directory in directories:
        for path in modules(directory):
            if not path.name.endswith(GENERATED):
                out[str(path.relative_to(ROOT))] = len(path.read_text(encoding="utf-8").splitlines())
    return out


def test_no_source_file_over_the_hard_limit_and_the_soft_ones_are_reported() -> None:
    counts = _line_counts(PACKAGES)
    assert counts, "no source files found"
    soft = {p: n for p, n in counts.items() if SOFT_LINES < n <= HARD_LINES}
    if soft:
        print(f"\nover the soft limit of {SOFT_LINES} lines: {dict(sorted(soft.items(), key=lambda kv: -kv[1]))}")
    assert {p: n for p, n in counts.items() if n > HARD_LINES} == {}


def test_router_loop_stays_small() -> None:
    assert _line_counts(["router"])["router/router.py"] < 200



def test_only_the_worker_client_calls_ray_remote_in_the_router() -> None:
    """router/workers.py's RayWorker is the router's one seam to Ray actors (WorkerClient)."""
    callers = set()
    for path in modules("router"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote":
                callers.add(str(path.relative_to(ROOT)))
    assert callers == {"router/workers.py"}
