"""Who used the CPUs while a benchmark phase ran: the machine's load, the share other processes
took (`CpuWatch`), the time the hypervisor stole, and cores by process (`process_cpu_snapshot`
before and after, `cpu_by_process` between). A benchmark records these beside its timings, so a
figure taken on a busy machine says so."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _system_busy_seconds() -> float | None:
    """CPU seconds all processes have spent busy since boot (/proc/stat; steal counts as busy)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except (OSError, IndexError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


class CpuWatch:
    """How much of the machine other processes used while a phase ran.

    `other_cpu_share` = (all busy CPU time - this process's CPU time) / (wall time * cores).
    Near 0 on a quiet machine; 0.25 on 2 cores means one other busy thread half the time.
    torch's threads wait for each other, so even a small share can slow a phase a lot.
    """

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.busy = _system_busy_seconds()
        t = os.times()
        self.own = t.user + t.system

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self.wall
        t = os.times()
        own = t.user + t.system - self.own
        busy_now = _system_busy_seconds()
        out: dict[str, Any] = {"wall_s": wall, "own_cpu_s": own, "load_average": load_average()}
        if self.busy is not None and busy_now is not None and wall > 0:
            others = max(0.0, busy_now - self.busy - own)
            out["other_cpu_share"] = min(1.0, others / (wall * (os.cpu_count() or 1)))
        return out




def steal_seconds() -> float | None:
    """CPU seconds stolen from this VM by its hypervisor since boot (/proc/stat), all cores together:
    time other guests on the same physical cores took."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        return int(fields[7]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _process_label(pid: int, ppid: int, cmdline: list[str], name: str, ours: set[int]) -> str:
    """'this process', 'ours: ray::DecodeActor' (a descendant: Ray's daemons and workers started by
    this process), 'other: python engine_bench.py', 'kernel: kworker'."""
    if pid == os.getpid():
        return "this process"
    if ppid == 2 or pid == 2:  # kthreadd's children
        return f"kernel: {name.split('/')[0]}"
    head = cmdline[0] if cmdline else name
    if head.startswith("ray::"):
        what = head.split(".")[0].split("(")[0].strip()  # "ray::DecodeActor.generate()" -> "ray::DecodeActor"
    else:
        what = os.path.basename(head.split()[0]) if head.strip() else name
        if what.startswith("python"):
            args = [a for a in cmdline[1:] if not a.startswith("-")]
            if "-m" in cmdline[1:3] and args:
                what = f"python -m {args[0]}"
            elif args:
                what = f"python {os.path.basename(args[0])}"
    return f"{'ours' if pid in ours else 'other'}: {what}"


def process_cpu_snapshot() -> dict:
    """pid -> (label, user+system CPU seconds, start time) for every process visible here (psutil),
    plus key None -> the snapshot's wall time. Labels tell this process's descendants ("ours:
    ray::RouterActor": Ray's daemons and workers, when this process started Ray) from everyone
    else's ("other: ...") and from kernel threads."""
    import psutil

    taken = time.time()
    try:
        ours = {c.pid for c in psutil.Process().children(recursive=True)}
    except psutil.Error:
        ours = set()
    out: dict = {None: taken}
    for p in psutil.process_iter(["pid", "ppid", "name", "cmdline", "cpu_times", "create_time"]):
        try:
            ct = p.info["cpu_times"]
            if ct is None:
                continue
            label = _process_label(p.pid, p.info["ppid"] or 0, p.info["cmdline"] or [], p.info["name"] or "?", ours)
            out[p.pid] = (label, ct.user + ct.system, p.info["create_time"] or 0.0)
        except (psutil.Error, OSError):
            continue
    return out


def cpu_by_process(before: dict, after: dict, wall_s: float) -> dict[str, float]:
    """Cores each process label used between two process_cpu_snapshot()s (CPU seconds / wall
    seconds, summed over the processes sharing a label, labelled as in `after`), largest first.
    A process started in between counts from zero; one already running but missed by `before`
    is left out."""
    used: dict[str, float] = {}
    for pid, rec in after.items():
        if pid is None:
            continue
        label, cpu, created = rec
        prev = before.get(pid)
        if prev is not None and abs(prev[2] - created) < 1e-3:
            delta = cpu - prev[1]
        elif created >= before.get(None, float("inf")) - 0.5:
            delta = cpu
        else:
            continue
        if delta > 0:
            used[label] = used.get(label, 0.0) + delta
    return dict(sorted(((k, v / wall_s) for k, v in used.items() if v / wall_s >= 0.005),
                       key=lambda kv: -kv[1]))


def cpu_mark() -> tuple[float, dict, float | None]:
    """A point to measure cores from: (wall time, process_cpu_snapshot(), steal_seconds())."""
    return time.perf_counter(), process_cpu_snapshot(), steal_seconds()


def cores_between(start: tuple[float, dict, float | None], end: tuple[float, dict, float | None]) -> dict:
    """Cores used between two cpu_mark()s: by process, and summed for ours (this process and its
    descendants), other people's processes, kernel threads, and the hypervisor's steal."""
    (t0, a, st0), (t1, b, st1) = start, end
    by = cpu_by_process(a, b, t1 - t0)

    def cores(*prefixes: str) -> float:
        return sum(v for k, v in by.items() if k.startswith(prefixes))

    return {"cores_by_process": by, "ours_cores": cores("ours:", "this process"), "other_cores": cores("other:"),
            "kernel_cores": cores("kernel:"),
            "steal_cores": (st1 - st0) / (t1 - t0) if st0 is not None and st1 is not None else None}
