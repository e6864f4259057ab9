"""A benchmark's frame: plan -> phases -> ratios -> JSON -> plot.

    args = bench_args(__doc__, "smoke run; writes NAME.quick.json", model=C.REAL_MODEL).parse_args(argv)
    run = BenchRun(NAME, TARGETS, args)              # the machine, the clock, the result's name
    plan = run.plan(FULL, QUICK)                     # the plan --quick picks
    a = run.phase("decode", phase_decode, plan)      # timed, with who else used the CPUs
    return run.finish({"ratio": ...}, plot=plot)     # JSON, plot, PASS/MISS table, exit code

Each phase records its wall time and the CPU share other processes took (raw.phase_cpu, a warning
above WARN_SHARE); with `keep_going` a phase that raises is recorded in raw.errors and returns
None, so one broken phase leaves the others' figures, and the run exits 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks import _common as C
from benchmarks.harness.cpu import CpuWatch, cpu_by_process, load_average, process_cpu_snapshot

T = TypeVar("T")
P = TypeVar("P")
WARN_SHARE = 0.05  # other processes' share of the CPUs above which a phase's figures are suspect


def bench_args(doc: str | None, quick_help: str, model: str | None = None, why: str = "",
               plot: bool = False, progress: bool = False, seed: bool = False,
               threads: bool = False) -> argparse.ArgumentParser:
    """The flags benchmarks share: --quick and --out-dir always; --model (default `model`, `why`
    it is that), --no-plot, --no-progress, --seed and --threads where the benchmark has them."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    if model is not None:
        ap.add_argument("--model", default=model, metavar=C.MODEL_METAVAR, help=C.model_help(model, why))
    if threads:
        ap.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core this process may use)")
    if seed:
        ap.add_argument("--seed", type=int, default=0, help="seed for prompts and lengths (default: 0)")
    ap.add_argument("--out-dir", type=Path, default=None, help="where results go (default: benchmarks/results)")
    if plot:
        ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    if progress:
        ap.add_argument("--no-progress", action="store_true", help="no progress bars (e.g. in CI logs)")
    return ap


class BenchRun:
    """One run of a benchmark: `<name>[.quick].json` in --out-dir (default benchmarks/results/)."""

    def __init__(self, name: str, targets: dict[str, str], args: argparse.Namespace, keep_going: bool = False,
                 by_process: bool = False, **machine: Any):
        """Call after setting torch's threads (machine_info records them). `by_process`: each phase
        also records the cores each process used (raw.phase_cpu[label].cores_by_process)."""
        self.title, self.targets, self.args = name, targets, args
        self.quick = bool(getattr(args, "quick", False))
        self.name = name + (".quick" if self.quick else "")
        self.keep_going, self.by_process = keep_going, by_process
        self.out_dir: Path | None = getattr(args, "out_dir", None)
        self.machine = C.machine_info(**machine)
        load, cores = (self.machine["load_average_start"] or [0.0])[0], os.cpu_count() or 1
        if load > 0.5 * cores:
            print(f"  WARNING: load average {load} on {cores} cores: other work competes for the CPUs, "
                  "so these numbers are not representative.")
        self.phase_cpu: dict[str, dict] = {}
        self.errors: dict[str, str] = {}
        self.raw: dict[str, Any] = {"quick": self.quick}
        self.t0 = time.perf_counter()

    @property
    def show(self) -> bool:
        """Progress bars on, unless --no-progress."""
        return not getattr(self.args, "no_progress", False)

    def plan(self, full: P, quick: P, **overrides: Any) -> P:
        """The plan --quick picks, with `overrides` (those not None) replaced; recorded as raw.plan."""
        plan = quick if self.quick else full
        overrides = {k: v for k, v in overrides.items() if v is not None}
        if overrides:
            plan = dataclasses.replace(plan, **overrides) if dataclasses.is_dataclass(plan) else {**plan, **overrides}
        self.raw["plan"] = dataclasses.asdict(plan) if dataclasses.is_dataclass(plan) else plan
        return plan

    def phase(self, label: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T | None:
        """fn(*args, **kwargs), timed, with the CPU share others took while it ran."""
        print(f"- {label} ...", flush=True)
        watch = CpuWatch()
        snap = process_cpu_snapshot() if self.by_process else None
        try:
            return fn(*args, **kwargs)
        except Exception:
            if not self.keep_going:
                raise
            self.errors[label] = traceback.format_exc()
            print(f"  ERROR in {label}:\n{self.errors[label]}", file=sys.stderr)
            return None
        finally:
            cpu = self.phase_cpu[label] = watch.stop()
            if snap is not None:
                by = cpu_by_process(snap, process_cpu_snapshot(), cpu["wall_s"])
                others = {k: v for k, v in by.items() if k.startswith("other:")}
                cpu.update(cores_by_process=by, other_people_cores=sum(others.values()))
                if cpu["other_people_cores"] > 0.1:
                    print(f"  WARNING: other people's processes used {cpu['other_people_cores']:.2f} cores during "
                          f"this phase ({', '.join(k for k, v in others.items() if v > 0.05)})")
            if cpu.get("other_cpu_share", 0.0) > WARN_SHARE:
                print(f"  WARNING: other processes used {cpu['other_cpu_share']:.0%} of the CPUs during this phase")
            gc.collect()  # drop the phase's engines and models before the next one loads

    def checkpoint(self, ratios: dict[str, float | None]) -> Path:
        """Write the JSON as it stands, so an interrupted long run keeps what it measured."""
        return C.write_result(self.name, self.machine, ratios, self.targets, self.raw, self.out_dir)

    def finish(self, ratios: dict[str, float | None], plot: Callable[[dict, dict], Any] | None = None,
               **raw: Any) -> int:
        """Write the JSON (raw: what phases stored in self.raw, then `raw`), the plot (`plot(ratios,
        raw)` returns a matplotlib figure) unless --no-plot, print the ratios; the exit code."""
        self.machine["load_average_end"] = load_average()
        self.raw.update(raw)
        self.raw.update(phase_seconds={k: v["wall_s"] for k, v in self.phase_cpu.items()},
                        phase_cpu=self.phase_cpu, total_seconds=time.perf_counter() - self.t0)
        if plot is not None and not getattr(self.args, "no_plot", False):
            try:
                print(f"wrote {C.save_figure(plot(ratios, self.raw), self.name, self.out_dir)}")
            except Exception:
                self.errors["plot"] = traceback.format_exc()
                print(f"  ERROR in plot:\n{self.errors['plot']}", file=sys.stderr)
        if self.errors:
            self.raw["errors"] = self.errors
        print(f"wrote {self.checkpoint(ratios)}")
        C.print_ratios(ratios, self.targets, title=f"{self.title} ({self.raw['total_seconds']:.0f} s)")
        return 1 if self.errors else 0
