"""Helpers shared by the benchmarks (not a benchmark itself: `make bench` skips `_*`): the
machine, the model, timing statistics, targets, the JSON result and its plot.

Every benchmark writes `benchmarks/results/<name>.json` shaped as

    {"machine": {...}, "ratios": {"<key>": float}, "targets": {"<key>": "<= 2.0"}, "raw": {...}}

`ratios` are dimensionless numbers measured against a baseline taken in the same run (a
bandwidth floor, another implementation, a cold path), so they stay meaningful across
machines; `targets` say what each ratio should satisfy; `raw` keeps every timing behind them.
A missed target is reported (MISS), never an error: benchmarks exit 0 so results are recorded.
"""
from __future__ import annotations

import json
import math
import operator
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

# CPU accounting lives in benchmarks.harness.cpu; its names stay importable from here.
from benchmarks.harness.cpu import CpuWatch as CpuWatch
from benchmarks.harness.cpu import cpu_by_process as cpu_by_process
from benchmarks.harness.cpu import load_average as load_average
from benchmarks.harness.cpu import process_cpu_snapshot as process_cpu_snapshot
from benchmarks.harness.cpu import steal_seconds as steal_seconds

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = Path(__file__).resolve().parent / "results"

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt,
}


# -- machine ------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def machine_info(**extra: Any) -> dict[str, Any]:
    """Facts that decide how comparable two result files are. Call after setting torch threads."""
    import torch

    info: dict[str, Any] = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "mem_total_gib": _mem_total_gib(),
        "load_average_start": load_average(),
        "torch": torch.__version__,
        "torch_num_threads": torch.get_num_threads(),
        "torch_num_interop_threads": torch.get_num_interop_threads(),
        "mkldnn": torch.backends.mkldnn.is_available(),
        "mkl": torch.backends.mkl.is_available(),
        "cuda": torch.cuda.is_available(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "argv": sys.argv[1:],
    }
    info.update(extra)
    return info


def set_all_threads(threads: int | None = None) -> int:
    """Let torch use `threads`, or every core this process may run on; returns the thread count."""
    import torch

    n = threads or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    torch.set_num_threads(max(1, n))
    return torch.get_num_threads()


# -- the model --------------------------------------------------------------------
# A real model by default (SmolLM2-135M-Instruct, from the registry: pulled, verified and
# converted on first use); the random-weight presets stay one flag away.
REAL_MODEL = "smollm2-135m"
MODEL_METAVAR = "tiny|bench|NAME|PATH"


def model_help(default: str, why: str = "") -> str:
    """--model's help: what it takes, the default, and (`why`) why that default where it is a preset."""
    return (f"the model: a preset (tiny, bench: random weights, no download), a registry model "
            f"({REAL_MODEL}, qwen2.5-coder-0.5b, ...: pulled on first use) or an HF checkpoint dir "
            f"(default: {default}{'; ' + why if why else ''})")


def prepare_model(name_or_path: str) -> dict[str, Any]:
    """Resolve --model once, up front (a registry model is pulled here, with its progress bar,
    not raced by the benchmark's worker processes); returns what raw records about it."""
    import json as _json

    from engine.presets import resolve_model

    path = resolve_model(name_or_path)
    cfg = _json.loads((Path(path) / "config.json").read_text())
    return {"name": name_or_path, "path": str(path), "architecture": (cfg.get("architectures") or ["?"])[0],
            "num_layers": cfg.get("num_hidden_layers"), "hidden_size": cfg.get("hidden_size"),
            "num_heads": cfg.get("num_attention_heads"), "num_kv_heads": cfg.get("num_key_value_heads"),
            "vocab_size": cfg.get("vocab_size")}


# -- measuring ----------------------------------------------------------------------
def measure_copy_bandwidth(mib: int = 256, reps: int = 7) -> dict[str, Any]:
    """Main-memory bandwidth from large float32 tensors, best of `reps`.

    copy: `dst.copy_(src)`, counting read + write bytes (2*N/t, STREAM "copy" convention).
    read: `src.sum()`, counting the bytes read (N/t). Tensors are far larger than any cache.
    """
    import torch

    n = mib * 2**20 // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    nbytes = n * 4
    copy_t, read_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        src.sum()
        read_t.append(time.perf_counter() - t0)
    del src, dst
    return {
        "tensor_bytes": nbytes,
        "reps": reps,
        "copy_bytes_per_s": 2 * nbytes / min(copy_t),
        "read_bytes_per_s": nbytes / min(read_t),
        "copy_seconds": copy_t,
        "read_seconds": read_t,
        "copy_median_bytes_per_s": 2 * nbytes / statistics.median(copy_t),
        "read_median_bytes_per_s": nbytes / statistics.median(read_t),
    }


def unique_weights(model: Any) -> list[Any]:
    """A model's parameters and weight buffers (quantized bytes, oneDNN-packed matrices; not the
    rotary tables), each storage once. Packed tensors have no data pointer: they count by id."""
    tensors = [*model.parameters(), *(b for n, b in model.named_buffers() if not n.startswith("rotary."))]
    return list({(id(t) if t.is_mkldnn else t.data_ptr()): t for t in tensors}.values())


def summarize(samples: Iterable[float]) -> dict[str, float]:
    """Median, mean, min, max, p10, p90 and count of a list of timings (same unit as input)."""
    xs = sorted(samples)
    if not xs:
        return {"n": 0}

    def pct(p: float) -> float:
        k = (len(xs) - 1) * p
        lo, hi = math.floor(k), math.ceil(k)
        return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)

    return {"n": len(xs), "median": statistics.median(xs), "mean": statistics.fmean(xs),
            "min": xs[0], "max": xs[-1], "p10": pct(0.1), "p90": pct(0.9)}


@contextmanager
def progress(description: str, total: float | None, enabled: bool = True):
    """A rich progress bar (transient) yielding `advance(n=1)`; a no-op when disabled."""
    if not enabled:
        yield lambda n=1: None
        return
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), transient=True, refresh_per_second=4) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n=1: bar.advance(task, n)


# -- targets and results ---------------------------------------------------------------
def parse_target(target: str) -> tuple[str, float]:
    """'<= 2.0' -> ('<=', 2.0)."""
    text = target.strip()
    for op in sorted(_OPS, key=len, reverse=True):
        if text.startswith(op):
            return op, float(text[len(op):])
    raise ValueError(f"target {target!r} must start with one of {', '.join(_OPS)}")


def meets(value: float | None, target: str) -> bool:
    if value is None or not math.isfinite(value):
        return False
    op, bound = parse_target(target)
    return _OPS[op](value, bound)


def print_ratios(ratios: dict[str, float | None], targets: dict[str, str], title: str = "") -> bool:
    """Print ratio | target | PASS/MISS side by side; returns True when every target is met."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("ratio")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    table.add_column("", justify="center")
    ok_all = True
    for key, value in ratios.items():
        target = targets.get(key)
        shown = "n/a" if value is None else f"{value:.3f}"
        if target is None:
            table.add_row(key, shown, "-", "")
            continue
        ok = meets(value, target)
        ok_all &= ok
        table.add_row(key, shown, target, "[green]PASS[/]" if ok else "[red]MISS[/]")
    Console().print(table)
    return ok_all


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return _jsonable(obj.item())
    return obj


def result_path(name: str, suffix: str = ".json", out_dir: Path | None = None) -> Path:
    return Path(out_dir or RESULTS_DIR) / f"{name}{suffix}"


def write_result(name: str, machine: dict, ratios: dict, targets: dict, raw: dict,
                 out_dir: Path | None = None) -> Path:
    """Write `<out_dir>/<name>.json` (default benchmarks/results/) atomically; returns its path."""
    path = result_path(name, ".json", out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = _jsonable({"machine": machine, "ratios": ratios, "targets": targets, "raw": raw})
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    os.replace(tmp, path)
    return path


# -- plotting -----------------------------------------------------------------------------
def bar_panel(ax, labels: list[str], values: list[float], title: str, ylabel: str,
              colors: list[str] | None = None, fmt: str = "{:.3g}") -> None:
    """One labelled bar chart on a matplotlib axis, each bar annotated with its value."""
    bars = ax.bar(labels, values, color=colors)
    for b, v in zip(bars, values):
        ax.annotate(fmt.format(v), (b.get_x() + b.get_width() / 2, b.get_height()),
                    ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.15)
    ax.tick_params(axis="x", labelsize=8)


def ratio_caption(key: str, ratios: dict, targets: dict) -> str:
    value, target = ratios.get(key), targets.get(key)
    if value is None:
        return f"{key}: n/a"
    verdict = "" if target is None else (" PASS" if meets(value, target) else " MISS")
    return f"{key} = {value:.2f} (target {target}){verdict}"


def new_figure(ncols: int, title: str, width_per_panel: float = 4.2, height: float = 4.0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width_per_panel * ncols, height), squeeze=False)
    fig.suptitle(title, fontsize=11)
    return fig, list(axes[0])


def save_figure(fig, name: str, out_dir: Path | None = None) -> Path:
    import matplotlib.pyplot as plt

    path = result_path(name, ".png", out_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def percentile(samples: Iterable[float], p: float) -> float | None:
    """The p-th percentile (0..100) with linear interpolation between order statistics (numpy's
    default); None for no samples."""
    xs = sorted(samples)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def latency_stats(samples: Iterable[float]) -> dict[str, float]:
    """n, mean, p50, p90, p99, max of latencies (same unit as input): the tail-latency view
    `summarize` leaves out."""
    xs = list(samples)
    if not xs:
        return {"n": 0}
    return {"n": len(xs), "mean": statistics.fmean(xs), "p50": percentile(xs, 50), "p90": percentile(xs, 90),
            "p99": percentile(xs, 99), "max": max(xs)}


