"""What a running `brigade serve`'s processes spend on this machine's CPU, for the serving path's
calibration (cluster/serving_costs.py): samples of every process's CPU time and the machine's,
the workers told apart by the titles Ray gives their processes, and the served engine steps'
own CPU from the server's step counters, so the CPU beside the steps can be taken per token."""
from __future__ import annotations

from typing import NamedTuple

import psutil

from cluster.steal import cpu_times_s
from loadtest import server_steps

# Ray titles an actor's process after its class: the workers' (their steps are the engine fit's).
WORKER_TITLES = ("ray::PrefillActor", "ray::DecodeActor", "ray::RankActor")
DECODE_TITLE = "ray::DecodeActor"


class StreamRun(NamedTuple):
    """Concurrent answers streamed at once, and what the machine spent beside the workers."""

    per_token_s: float  # median time per token after the first
    second_gap_s: float  # median time from the first token to the second
    cpu_s: float  # CPU seconds of every process but the workers'
    wall_s: float
    tokens: int
    requests: int
    # The workers' own CPU seconds beyond their engine steps' (their actors' and Ray's threads),
    # and the steps they took; None where the server counts no steps (engine/step_log.py)
    worker_cpu_s: float | None = None
    steps: int = 0
    decode_step_cpu_s: float | None = None  # the served decode steps' mean CPU (engine/step_log.py)


class CpuSample(NamedTuple):
    """The machine's CPU counters at one moment."""

    busy_s: float  # every process's CPU time together, exited ones' too (/proc/stat)
    procs_s: dict[int, float]  # each live process's own, by pid
    workers: frozenset[int]  # the pids Ray had titled as a worker by then


def cpu_by_pid() -> tuple[dict[int, float], dict[int, str]]:
    """CPU seconds of every live process, and each one's title (its argv[0]), by pid."""
    cpu_s, titles = {}, {}
    for proc in psutil.process_iter(["cmdline", "cpu_times"]):
        cmd, cpu = proc.info["cmdline"] or [""], proc.info["cpu_times"]
        if cpu is not None:
            cpu_s[proc.pid], titles[proc.pid] = cpu.user + cpu.system, cmd[0]
    return cpu_s, titles


def titled_cpu_s(titles: str | tuple[str, ...]) -> dict[int, float]:
    """CPU seconds of each process Ray titled one of `titles` (an actor class's), by pid."""
    cpu_s, named = cpu_by_pid()
    return {pid: cpu for pid, cpu in cpu_s.items() if named[pid].startswith(titles)}


def cpu_sample() -> CpuSample:
    # The machine's busy time, not a sum over the processes alive now: a process that exits
    # between two samples (a Ray helper, a gRPC call's) would take its CPU out of the sum, and
    # an idle second measured that way once came out at -0.71 cores, which tripled stream_cpu_s.
    # Every process's own CPU is kept, not only the workers': Ray titles a pre-started worker
    # only when an actor lands on it, seconds of imports later, and a worker titled between two
    # samples must be charged from the first, not from its start (-8 s once, in a test).
    cpu_s, titles = cpu_by_pid()
    return CpuSample(cpu_times_s()[0], cpu_s,
                     frozenset(pid for pid, title in titles.items() if title.startswith(WORKER_TITLES)))


def cpu_of(title: str) -> float:
    """CPU seconds of the processes Ray titled `title`, together."""
    return sum(titled_cpu_s(title).values())


def workers_cpu_s(since: CpuSample, until: CpuSample) -> float:
    """CPU seconds the workers' processes spent between two samples, every thread of each."""
    return sum(until.procs_s[pid] - since.procs_s.get(pid, 0.0) for pid in until.workers)


def serving_cpu_s(since: CpuSample, until: CpuSample) -> float:
    """CPU seconds the machine spent between two samples outside the workers: the door, the
    router, Ray's and Redis's own, the kernel's, this client."""
    return (until.busy_s - since.busy_s) - workers_cpu_s(since, until)


def steps_cpu(before: dict | None, after: dict | None, kind: str | None = None) -> tuple[float, int] | None:
    """The served engine steps' own CPU seconds and count between two reads of the server's step
    counters (loadtest/server_steps.py), over every worker (`kind`: "decode" or "prompt" steps
    only); None where it counts none."""
    if before is None or after is None:
        return None
    tallies = [t for kinds in server_steps.between(before, after).values()
               for k, batches in kinds.items() if kind in (None, k) for t in batches.values()]
    return sum(t["cpu_s"] for t in tallies), sum(t["steps"] for t in tallies)


def worker_stream_cpu_s(runs: list[StreamRun], idle_rate: float, per_step_s: float, per_token_s: float
                        ) -> float | None:
    """Per streamed token, the workers' own CPU beyond what the simulator charges their steps:
    their processes' CPU over `runs` less their engine steps' (the served step log's), their
    idle rate over the runs' wall time, and the steps' serving overheads (`per_step_s` a step,
    `per_token_s` a sampled sequence: part of each simulated step's work). Their actors' and Ray's
    threads hand each token on beside the engine thread: on the 2-core Xeon here 18.6-19.0 ms of
    the worker process's CPU a token where its steps took about 15, which alone runs on the idle
    core, and two workers answering at once have none (their answers 23.2 ms a token, not 18.3).
    None where the server counts no steps."""
    if not runs or any(r.worker_cpu_s is None for r in runs):
        return None
    tokens = sum(r.tokens for r in runs)
    charged = per_step_s * sum(r.steps for r in runs) + per_token_s * tokens
    beyond = sum(r.worker_cpu_s for r in runs) - idle_rate * sum(r.wall_s for r in runs) - charged
    return beyond / max(1, tokens)
