"""A host's CPU cores shared by everything that runs on them: processor sharing on the
virtual clock.

On a GPU node each worker has its device to itself and the host's cores are not what limits
a step, so the catalog's GPU profiles have no host. On a CPU machine the workers' engine
threads, the door, the router and the streaming of every token all run on the same few
cores: when more of them are runnable than there are cores, each gets a fair share and
every one of them runs slower. A `CpuHost` with `cores` runs each job (seconds of one core's
work) at min(1, cores / jobs running) until its work is done; a job that joins or leaves
changes the rate of all the others, so their ends are re-planned then. The serve's own
processes keep `background` cores busy with no request in flight (Ray's, Redis's and the
workers' polling and heartbeats: DeviceProfile.background_cores): while the jobs fit beside it
each still has a core, and when they do not they share what it leaves, and a step among them
does its work `oversubscribed_slowdown` times slower (the threads that preempt it on its core
take its caches too: DeviceProfile.oversubscribed_slowdown).

A fair share is not all a step loses there: a step computing prompt tokens while another
worker's step decodes waits on the run queue far longer than the serving path's CPU time
explains (measured with /proc/thread-self/schedstat on the 2-core machine here, one prefill
worker beside one decoding worker: a hit's prefill step of 50 ms of CPU waited 15-27 ms, the
decode steps beside it 2-4 ms): every decode step's tokens wake the actor's, Ray's, the
router's and the door's short-lived threads, which preempt it. So while another step that
decodes runs, a prompt step gets at most 1 / `corun_slowdown` of a core (1: no limit), and
less when its fair share is less: a full machine's scheduler is fair over a step's length, and
the preempting threads' CPU is already a job here (the streaming's), so the ceiling is not
applied on top of the share. A prompt step that starts beside decoding steps also waits
first (off the cores): `corun_wait_s`, and `corun_wait_per_answer_s` more for each answer they
decode beyond the first. The growth is part fixed, and it grows with the answers streaming
(each token wakes its own chunk's way out): measured per request in stop 44's recorded run,
one prefill + one decode worker's hits grew about 23 ms beside one answer and 7-8 ms more per
answer after it. One wait, fitted beside one answer, either fixed put the hits beside three
answers 17-26 ms low (re-simulated from stop 42's recorded run) or per answer 21-28 ms high
(stop 44's). A step that decodes answers of its own (a colocated worker's mixed step) is spared
both: it runs in the streaming's rhythm, and with them two colocated workers' hits beside three
answers were simulated up to 12 ms high, without them within 2 ms. A colocated fleet takes the
ceiling and not the waits (sim/fleet.py): its hits take no way through a decode worker busy with
its steps, and measured per request in stop 45's two runs they grew 9-23 ms beside one answer
where 1P+1D's grew 30-38 at 1 and 2 req/s, on the same engine; but its prompt steps beside the
other worker's answers took 1.18-1.22x their simulated time without the ceiling (stop 46's first
run), 0.93-1.14x with it (four runs before). Re-simulated on those five runs, the colocated hits
beside one answer missed by 100 ms in all (the per-rate medians' misses summed) with the ceiling
alone, 127 with neither, and with both one calibration's 15 ms wait put them 27-40 ms high.
Measured on one 1P+1D serve,
hits of 4 and of 96 new tokens over a cached 512-token prefix grew by 39 and 74 ms beside one
stream: a ceiling alone fitted to the short hit (about 2) gave the long one 134 ms, and no
ceiling matches both; a 10 ms wait and a 1.35 ceiling give 39 and 75 (the wait per answer
is fitted after them, on hits beside three answers). Two prompt steps side
by side (cold prompts on two workers) wake no such threads and are not slowed. An earlier form
applied the ceiling only while streaming work was pending; it could not reach the growth
measured beside 2 streams (its fit stopped at its bound in 4 of 5 calibrations) and gave a hit
sent as another hit starts decoding less than half of the 18 ms it lost
(benchmarks/sim_micro.py's hit_after_hit). `brigade sim calibrate --disagg-url` fits both
(cluster/serving_costs.py, sim/corun.py).

The decoding side loses too: while another worker's step computes prompt tokens, a step of a
disaggregated decode worker gets at most 1 / `decode_corun_slowdown` of a core (1: no limit).
Each prompt's way in wakes the decode worker's own threads (its reservation, the KV pull, the
admit), which take the engine thread's turn in its process; a colocated worker's decode step
beside another's prompt has none of that (with the ceiling on it too, two colocated workers'
answers at 4 req/s were simulated 16% slow in a run of stop 44 that fitted 1.75; without, 11%,
its engine fits taken in slow spells: its served decode steps took 0.87x the simulated ones).
In stop 43's validations the served decode steps took 1.03-1.20x the simulated ones, and
per request the 1P+1D answers with a prompt arriving beside them were simulated 5-14% lower
than those alone, in every try. Re-simulated with a ceiling of 2 on every worker's decode
steps, three recorded runs' largest TPOT errors went 0.229, 0.217, 0.265 -> 0.134, 0.169, 0.175
(docs/SIMULATOR.md, "Answers beside prompts"). Calibrate fits it from the co-run scene's
answer, its pace beside the hits against before them (sim/corun.py's fit_decode_corun).
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(eq=False)  # a job is itself: `in` and remove() go by identity
class _Job:
    left_s: float  # of one core's work
    done: asyncio.Future
    step: bool = False  # a worker's engine step (not a request's way in or out)
    prompt: bool = False  # a step that computes prompt tokens (with decode 0, corun_slowdown applies to it)
    decode: int = 0  # the running answers whose tokens the step samples (which stream out)
    receiving: bool = False  # a disaggregated decode worker's step (its requests come in from prefill workers)
    started: float = 0.0  # when it joined the cores (corun_span_s counts from there)


class CpuHost:
    def __init__(self, cores: float, corun_slowdown: float = 1.0, corun_wait_s: float = 0.0,
                 decode_corun_slowdown: float = 1.0, corun_wait_per_answer_s: float = 0.0,
                 corun_span_s: float | None = None, background: float = 0.0,
                 oversubscribed_slowdown: float = 1.0):
        if cores <= 0:
            raise ValueError(f"a host needs cores > 0, not {cores}")
        if not 0 <= background < cores:
            raise ValueError(f"the serve's background work ({background:g} cores busy with no request in flight) "
                             f"must leave some of the host's {cores:g} cores to its steps: a fleet this large does "
                             "not fit this host (fewer workers, or a profile with more host_cores)")
        if corun_slowdown < 1:
            raise ValueError(f"corun_slowdown is a slowdown (>= 1), not {corun_slowdown}")
        if corun_wait_s < 0:
            raise ValueError(f"corun_wait_s is a wait (>= 0), not {corun_wait_s}")
        if corun_wait_per_answer_s < 0:
            raise ValueError(f"corun_wait_per_answer_s is a wait (>= 0), not {corun_wait_per_answer_s}")
        if decode_corun_slowdown < 1:
            raise ValueError(f"decode_corun_slowdown is a slowdown (>= 1), not {decode_corun_slowdown}")
        if oversubscribed_slowdown < 1:
            raise ValueError(f"oversubscribed_slowdown is a slowdown (>= 1), not {oversubscribed_slowdown}")
        if corun_span_s is not None and corun_span_s <= 0:
            raise ValueError(f"corun_span_s is a time (> 0) or None (the whole step), not {corun_span_s}")
        self.cores, self.corun_slowdown, self.corun_wait_s = cores, corun_slowdown, corun_wait_s
        self.decode_corun_slowdown, self.corun_wait_per_answer_s = decode_corun_slowdown, corun_wait_per_answer_s
        self.corun_span_s = corun_span_s
        self.background = background  # cores the serve's idle polling keeps busy (DeviceProfile.background_cores)
        self.oversubscribed_slowdown = oversubscribed_slowdown
        self.cpu_s = 0.0  # work done, all jobs together
        self._jobs: list[_Job] = []
        self._since = 0.0  # when the jobs' left_s were last brought up to date
        self._timer: asyncio.TimerHandle | None = None
        self._background: _Job | None = None
        self._idle_since = float("-inf")  # when the last job left (-inf: never busy; None: busy now)

    @property
    def running(self) -> int:
        return len(self._jobs)

    def idle_s(self, now: float) -> float:
        """How long no job has run on the cores (0 while one does; inf before any ran)."""
        return 0.0 if self._idle_since is None else now - self._idle_since

    def rate(self) -> float:
        """How fast each running job advances now (1: a core of its own): a fair share of the
        cores the background work leaves, once the jobs need more than that."""
        return min(1.0, (self.cores - self.background) / len(self._jobs)) if self._jobs else 1.0

    def _rate(self, job: _Job) -> float:
        """`job`'s own rate from now on: the fair share (a step's divided by oversubscribed_slowdown
        while more jobs run than the background leaves cores), at most 1 / corun_slowdown for a prompt
        step of no answers of its own beside another step that decodes (within corun_span_s of
        its start), and 1 / decode_corun_slowdown for a receiving worker's decode step beside a
        prompt step."""
        share = self.rate()
        if job.step and share < 1.0:  # more jobs than the cores the background leaves
            share /= self.oversubscribed_slowdown
        if self._capped(job):
            return min(share, 1.0 / self.corun_slowdown)
        if (job.receiving and job.decode and self.decode_corun_slowdown > 1
                and any(j.prompt and j is not job for j in self._jobs)):
            return min(share, 1.0 / self.decode_corun_slowdown)
        return share

    def _capped(self, job: _Job) -> bool:
        """The prompt step's ceiling holds now."""
        return (job.prompt and not job.decode and self.corun_slowdown > 1 and bool(self._decoding())
                and self._span_left(job) > 0)

    def _span_left(self, job: _Job) -> float:
        """How long the ceiling may still hold on `job` (inf: the whole step)."""
        if self.corun_span_s is None:
            return float("inf")
        left = job.started + self.corun_span_s - self._since
        return left if left > 1e-9 else 0.0  # a rounding's worth past the end is past it

    def _decoding(self) -> int:
        """The answers the running steps sample tokens of."""
        return sum(j.decode for j in self._jobs)

    def spend(self, cpu_s: float) -> None:
        """Add `cpu_s` to the background work nobody waits for (the serving path's streaming:
        one thread of it, the router and the door handing chunks on); it takes its share of
        the cores while any is left."""
        if cpu_s <= 0:
            return
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        if self._background is None or self._background not in self._jobs:
            self._background = _Job(0.0, loop.create_future())
            self._jobs.append(self._background)
        self._background.left_s += cpu_s
        self._plan(loop)

    async def run(self, cpu_s: float, step: bool = False, prompt: bool = False, decode: int = 0,
                  receiving: bool = False) -> None:
        """Take `cpu_s` seconds of one core's work, at this host's fair share (`step`: a
        worker's engine step; `prompt`: one that computes prompt tokens; `decode`: the running
        answers it samples tokens of; `receiving`: the worker takes its requests in from prefill
        workers. A prompt step with no answers, started beside other steps that decode, first
        waits corun_wait_s and corun_wait_per_answer_s more per answer they decode beyond the
        first, then runs at most at 1 / corun_slowdown of a core while any does; a receiving
        worker's decode step at most at 1 / decode_corun_slowdown while a prompt step runs)."""
        if cpu_s <= 0:
            return
        if step and prompt and not decode and (answers := self._decoding()):
            if wait := self.corun_wait_s + self.corun_wait_per_answer_s * (answers - 1):
                await asyncio.sleep(wait)
        loop = asyncio.get_running_loop()
        self._advance(loop.time())
        job = _Job(cpu_s, loop.create_future(), step, step and prompt, decode if step else 0, step and receiving,
                   loop.time())
        self._jobs.append(job)
        self._plan(loop)
        try:
            await job.done
        finally:
            if job in self._jobs:  # cancelled before its work was done (a killed worker): leave now
                self._advance(loop.time())
                self._jobs.remove(job)
                self._plan(loop)

    def _advance(self, now: float) -> None:
        dt = now - self._since
        if dt > 0 and self._jobs:
            # The rates as they were over the interval (the plan ends it where any would change).
            for job, rate in [(job, self._rate(job)) for job in self._jobs]:
                self.cpu_s += dt * rate
                job.left_s -= dt * rate
        self._since = now

    def _plan(self, loop: asyncio.AbstractEventLoop) -> None:
        """Finish the jobs whose work is done; set the timer for the next one to finish."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        done = [j for j in self._jobs if j.left_s <= 1e-9]
        if done:
            self._jobs = [j for j in self._jobs if j.left_s > 1e-9]
            for j in done:
                if not j.done.done():
                    j.done.set_result(None)
        if not self._jobs:
            if self._idle_since is None:
                self._idle_since = self._since
            return
        self._idle_since = None
        first = min(j.left_s / self._rate(j) for j in self._jobs)
        # A ceiling that ends before then changes the rates: plan again at its end.
        first = min([first] + [self._span_left(j) for j in self._jobs if self._capped(j)])
        self._timer = loop.call_at(self._since + first, self._tick, loop)

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        self._advance(loop.time())
        self._plan(loop)
