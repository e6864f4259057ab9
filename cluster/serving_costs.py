"""`brigade sim calibrate --url/--disagg-url`: the serving path's costs beyond the engine's
steps, measured on a running `brigade serve` with loadtest's HTTP target (so it lives at the
edge: sim/ imports only engine and router), into a device profile's request_overhead_s,
request_overhead_per_token_s, token_overhead_s, stream_cpu_s (with host_cores, background_cores,
worker_background_cores and oversubscribed_slowdown), handoff_overhead_s,
kv_receive_cpu_per_token_s, corun_wait_s, corun_wait_per_answer_s, corun_slowdown, corun_span_s,
decode_corun_slowdown and request_jitter_s."""
from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext

from cluster.serve_cpu import (
    DECODE_TITLE,
    StreamRun,
    cpu_of,
    cpu_sample,
    serving_cpu_s,
    steps_cpu,
    worker_stream_cpu_s,
    workers_cpu_s,
)
from cluster.steal import StealMeter
from loadtest.targets import TargetConfig, make_target
from loadtest.types import Message, Prompt
from sim.corun import (
    HitScene,
    HitTtfts,
    StreamGaps,
    fit_corun,
    fit_corun_span,
    fit_decode_corun,
    fit_wait_per_answer,
    handoff_to_match,
    jitter_quantiles,
)
from sim.corun_joint import refine_jointly
from sim.cost import Roofline, StepWork
from sim.hardware import DeviceProfile
from sim.shapes import ModelShape
from sim.step_timer import EngineBeside, StepTimer

# The streamed answers' prompt and length (measure_serving's defaults), and so the context of
# the decode batch a StepTimer beside them times.
SHORT_LEN, DECODE_TOKENS = 4, 48


def step_timer(preset: str, dtype: str = "auto", threads: int | None = None) -> StepTimer:
    """The engine measure_serving times beside the serve: `threads` as one served worker has,
    its decode sequences at the streamed answers' mean context."""
    return StepTimer(preset, dtype, context=SHORT_LEN + DECODE_TOKENS // 2, threads=threads)


def _step_and_token_overheads(one: float, many: float, width: int) -> tuple[float, float]:
    """A served decode step's cost beyond the engine's, per step and per streamed token, from
    what one stream and `width` streams at once cost beyond it: the line through the two, and
    where that crosses below 0 (one stream served faster than the engine's own step timed
    beside it: noise), the best fit with that term 0 rather than the line clamped, which would
    add the lost part to every step."""
    per_seq = (many - one) / (width - 1)
    per_step = one - per_seq
    if per_step < 0:
        per_step, per_seq = 0.0, max(0.0, (one + width * many) / (1 + width * width))
    elif per_seq < 0:
        per_step, per_seq = max(0.0, (one + many) / 2), 0.0
    return per_step, per_seq


# The idle seconds after which calibrate --url times a step and a request (DeviceProfile.cold_step_s):
# on the AVX-512 Xeon here a decode step grew 2.8 ms after 50 ms idle and 10 ms after 2 s.
COLD_IDLE_S = (0.1, 0.4, 1.0, 2.0)


def cold_tables(engine_s: dict[float, float], served_s: dict[float, float]
                ) -> tuple[tuple[tuple[float, float], ...], tuple[tuple[float, float], ...]]:
    """DeviceProfile.cold_step_s and cold_request_s from an engine step's and a served request's
    times after each idle (0: right after the last): the step's growth, and the request's beyond
    it (its step is the engine's too), each at least 0."""
    idles = sorted(i for i in engine_s if i > 0 and i in served_s)
    step = {i: max(0.0, engine_s[i] - engine_s[0.0]) for i in idles}
    return (tuple((i, step[i]) for i in idles),
            tuple((i, max(0.0, served_s[i] - served_s[0.0] - step[i])) for i in idles))


def measure_serving(url: str, profile: DeviceProfile, shape: ModelShape, disaggregated: bool = False,
                    requests: int = 8, short_len: int = SHORT_LEN, long_len: int = 516,
                    decode_tokens: int = DECODE_TOKENS,
                    streams: int = 4, rounds: int = 8, stream_rounds: int = 4, idle_s: float = 6.0,
                    block_size: int = 16, corun_width: int = 1, corun_wide_width: int = 3,
                    corun_phases: int = HitScene.phases,
                    receive_requests: int = 3, cold_rounds: int = 5, oversubscribed_rounds: int = 4,
                    timer: StepTimer | None = None) -> tuple[DeviceProfile, dict]:
    """The serving path's costs on a running `brigade serve` at `url` (of the preset the profile
    was fitted on), through loadtest's HTTP target as `brigade bench` sends requests; distinct
    prompts (no prefix hit) but where said. A colocated serve gives
    - worker_step_overhead_s and token_overhead_s: what a served worker's decode step costs
      beyond the engine's fitted one, per step (its loop, the actor) and per sampled sequence
      (its chunk's way out of the engine and the actor): the mean time per token of one
      `decode_tokens`-token answer and of `streams` at once, in `stream_rounds` interleaved
      rounds (two put a disaggregated decode worker's cost per token at 1.0, 2.4 and 3.2 ms in
      three calibrations of one day, and the 1P+1D validation's TPOT moved with it),
      less the fitted steps of those batches, as a line through the two;
    - request_overhead_s + request_overhead_per_token_s * prompt tokens, once per request (the
      door, the router's pick and index lookup, the actor calls, the prompt's ids through
      each): the median TTFTs of one-token answers to a `short_len`-token prompt and to a
      `long_len`-token one whose full blocks are cached (so its prefill step is short and its
      noise does not drown the serving path's per-token cost), one at a time, less their
      prefill steps, as a line through the two;
    - stream_cpu_s: per streamed token, the CPU the machine spends beside the worker's steps
      (the router, the door and the client hand each chunk on, in their own processes, and
      the worker's actor and Ray threads in its own, on the same cores): over those streams,
      the CPU time of every process but the workers' less its idle rate and their requests'
      way in, per token, and with `timer` of one torch thread the workers' own beyond their
      steps (worker_stream_cpu_s);
    - host_cores: the cores this process may run on (the serve runs on the same machine);
    - background_cores and worker_background_cores: of those, what the serve's processes beside
      the workers and each worker's keep busy over `idle_s` with no request in flight;
    A disaggregated one (`disaggregated`, measured after the colocated one) gives
    handoff_overhead_s: what its short TTFT holds beyond that (the decode worker's reservation
    and the prefill worker's answer, actor calls the simulated network does not time), set
    again on a CPU host so that the co-run scene's lone hits (below) take what they were
    measured to (sim/corun.py's handoff_to_match), and
    decode_worker_step_overhead_s and decode_token_overhead_s: the same two of its decode
    worker, from the same streams; on a CPU host kv_receive_cpu_per_token_s: the decode
    worker's CPU per request of `receive_requests` distinct `long_len`-token prompts and of
    `short_len`-token ones (2 tokens each: every prompt's KV crosses), less its idle rate over
    each request's time, as a line through the two; and corun_wait_s and corun_slowdown: the
    median TTFTs of hits (2 tokens each) sent on a beat alone and beside `corun_width` long
    answers, in `rounds` interleaved rounds, in turn a `long_len`-token prompt (its full blocks
    cached), those blocks with more new tokens of their own, and `long_len` tokens of its own
    (a cold prompt, for corun_span_s: sim/corun.py's fit_corun_span), whose growths the
    simulator is fitted to (sim/corun.py; the scene simulated
    at `corun_phases` phases of the decode steps: each costs the fit's grid once more). Eight
    rounds (about a minute), not two: with six short hits a width in each, two calibrations put
    the short hits' growth at 24 and 37 ms (and the fit's wait at 2.5 and 20 ms), three longer
    scenes at 27-29; with four, the answer's pace beside the hits came out 1.11, 1.08 and 1.06x
    its pace before them in three calibrations on one serve (a round's alone, 1.0-1.36x). One
    answer, not two: beside two, sharing the cores already gave the long hits most of their measured
    growth in the simulation, and the fit put the rest in a fixed 25 ms wait and no ceiling,
    which predicted the validation's 1P+1D tries worse than the one-answer fit (10 ms, 1.35).
    corun_wait_per_answer_s: the same hits beside `corun_wide_width` answers (a third scene in
    each round; 0: none, the wait the same beside any number), fitted after those two
    (sim/corun.py's fit_wait_per_answer).
    decode_corun_slowdown: from the first answer's pace in those scenes, its tokens' mean gap
    while the hits run against before the first (sim/corun.py's fit_decode_corun).
    request_jitter_s: the spread of the short lone hits' TTFTs about their median (sim/corun.py's
    jitter_quantiles).
    With `timer` (a CPU host), the colocated serve also gives cold_step_s and cold_request_s:
    the engine's decode step timed in this process after each idle of COLD_IDLE_S against one
    right after another, and a cached `long_len`-token prompt's TTFT on the serve likewise; the
    request's growth beyond the step's is the serving path's (cold_tables). `cold_rounds`
    interleaved rounds of each (about 3.5 s of idle a round, twice).
    With `timer` of one torch thread, also oversubscribed_slowdown: a served decode step's CPU
    (its step log) with another engine stepping decodes in a process beside it, against alone,
    one answer each, `oversubscribed_rounds` interleaved rounds (at least 1).
    `timer` (sim/step_timer.py, the engine of the same preset and threads as a served worker)
    times the engine's own step in this process just before each streaming round and each TTFT
    measurement, and what the serve adds is measured against that: this machine's speed drifts
    by tens of percent within minutes, and against the profile's fit, taken minutes earlier,
    the whole drift landed in the serving terms (a decode worker's 7 ms per token beyond the
    engine in one slow spell, 3 in the next calibration). Without it, against the profile's steps.
    What was seen includes `steal_share`: the share of the CPU time the machine wanted that its
    hypervisor took meanwhile (cluster/steal.py); above STOLEN the figures are the neighbours'.
    The profile with them set, and what was seen."""
    ids = iter(range(10**9))
    # Every prompt's first token: this call's own, so a call measured again on the same serve
    # (a stolen try) finds none of its "distinct" prompts cached by the last one.
    first_token = 101 + time.monotonic_ns() % 997
    stolen = StealMeter()

    async def one(target, prompt_len: int, max_tokens: int, i: int | None = None,
                  token_ids: list[int] | None = None, times: list[float] | None = None
                  ) -> tuple[float, float, int, float]:
        """(TTFT, the last token's time, tokens, the first token's time to the second's) of one
        answer (to `token_ids` where given); `times` gets each token's time as it comes (on
        time.perf_counter's clock), and keeps them if the answer is cancelled."""
        i = next(ids) if i is None else i  # the same i: the same prompt (a prefix hit after the first)
        tokens = token_ids or [first_token] + [101 + (7 * i + 13 * j) % 997 for j in range(1, prompt_len)]
        prompt = Prompt(f"calibrate-{i}", "calibrate", (Message("user", tokens),), max_tokens)
        sent = time.perf_counter()
        chunks = []
        async for c in target.stream(prompt):
            if c.num_tokens:
                chunks.append(c)
                if times is not None:
                    times += [c.time] * c.num_tokens
        second = chunks[1].time - chunks[0].time if len(chunks) > 1 else 0.0
        return chunks[0].time - sent, chunks[-1].time - sent, sum(c.num_tokens for c in chunks), second

    def target():
        return make_target(TargetConfig(url=url, ignore_eos=True, return_token_ids=True, timeout_s=120))

    async def ttfts(prompts: dict[int, bool]) -> dict[int, float]:
        """The median TTFT of one-token answers to each prompt length (True: the same prompt
        every time, a prefix hit after the first), the lengths taken in turn, so a slow spell
        weighs on both (measured one length after the other, two calibrations half an hour
        apart put the line's slope at 17.5 and 50.7 us a prompt token)."""
        t = target()
        same = {n: next(ids) if hit else None for n, hit in prompts.items()}
        seen_s: dict[int, list[float]] = {n: [] for n in prompts}
        try:
            for k in range(2 + requests):  # two to warm the path up (and cache the prompt, for a hit)
                for n in prompts:
                    first = (await one(t, n, 1, same[n]))[0]
                    if k >= 2:
                        seen_s[n].append(first)
            return {n: statistics.median(v) for n, v in seen_s.items()}
        finally:
            await t.aclose()

    async def hits_beside(width: int, scene: HitScene) -> tuple[tuple[list[float], ...], StreamGaps | None]:
        """TTFTs of the scene's hits by kind (short, long, cold), sent on its beat while
        `width` answers stream, and the first answer's pace before and beside them (None without
        one, or where it ended before the hits)."""
        t = target()
        salt = next(ids)  # this scene's own prompts: none cached by an earlier one
        hit = [first_token + salt % 97] + scene.hit_prompt()[1:]
        try:
            for _ in range(2):  # warm the path up and cache the prompt
                await one(t, 0, 2, token_ids=hit)
            answer: list[float] = []
            began = time.perf_counter()
            streams = [asyncio.create_task(one(t, scene.short_len, scene.stream_len, times=answer if not i else None))
                       for i in range(width)]
            await asyncio.sleep(scene.settle_s)  # past their prefills: decoding
            first_hit = time.perf_counter()

            async def hit_k(k: int) -> tuple[float, float]:
                """Hit k's TTFT and when it was answered: sent on the scene's beat whether or not
                the last was answered, as the simulator sends them (a cold prompt slower than the
                beat, as on a slower machine, then delays the next in both)."""
                await asyncio.sleep(max(0.0, first_hit + k * scene.spacing_s - time.perf_counter()))
                ttft = (await one(t, 0, 2, token_ids=scene.prompt(hit, k, salt, first=first_token)))[0]
                return ttft, time.perf_counter()

            got = await asyncio.gather(*(hit_k(k) for k in range(scene.hits)))
            ttfts: tuple[list[float], ...] = ([], [], [])
            for k, (ttft, _) in enumerate(got):
                ttfts[scene.kind(k)].append(ttft)
            answered = max(end for _, end in got)
            for task in streams:  # closes their connections: the router aborts them
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            try:
                pace = StreamGaps.of(answer, began, first_hit, answered, scene) if width else None
            except ValueError:  # the answer ended before the hits (a fast model): nothing to time
                pace = None
            return ttfts, pace
        finally:
            await t.aclose()

    async def after_idle(measure: Callable[[], Awaitable[float]]) -> dict[float, float]:
        """`measure()` after each idle in COLD_IDLE_S and right after the last (0): each one's
        median over `cold_rounds` interleaved rounds."""
        seen_s: dict[float, list[float]] = {idle: [] for idle in (0.0, *COLD_IDLE_S)}
        for _ in range(cold_rounds):
            for idle in COLD_IDLE_S:
                await asyncio.sleep(idle)
                seen_s[idle].append(await measure())
                seen_s[0.0].append(await measure())
        return {idle: statistics.median(v) for idle, v in seen_s.items()}

    async def engine_after_idle() -> dict[float, float]:
        """The engine's decode step (one sequence of `long_len` tokens), as after_idle times it."""
        async def step() -> float:
            return timer.decode(1, 1, long_len)[0]

        return await after_idle(step)

    async def served_after_idle() -> dict[float, float]:
        """The TTFT of a one-token answer to a cached `long_len`-token prompt, as after_idle times it."""
        t = target()
        same = next(ids)
        try:
            for _ in range(2):  # warm the path up and cache the prompt
                await one(t, long_len, 1, same)

            async def ttft() -> float:
                return (await one(t, long_len, 1, same))[0]

            return await after_idle(ttft)
        finally:
            await t.aclose()

    async def decode_cpu(prompt_len: int) -> tuple[float, float]:
        """The decode worker's CPU seconds and the wall time per request of distinct (so cold)
        `prompt_len`-token prompts, sent one at a time."""
        t = target()
        try:
            await one(t, prompt_len, 2)
            cpu, wall = cpu_of(DECODE_TITLE), time.perf_counter()
            for _ in range(receive_requests):
                await one(t, prompt_len, 2)
            cpu, wall = cpu_of(DECODE_TITLE) - cpu, time.perf_counter() - wall
            return cpu / receive_requests, wall / receive_requests
        finally:
            await t.aclose()

    async def streaming(width: int) -> StreamRun:
        """`width` concurrent answers."""
        t = target()
        try:
            await one(t, short_len, 4)
            # The step counters are read outside the CPU samples: the router asks each worker for
            # them, an actor call whose CPU is the worker's but no streamed token's.
            steps_before = await t.server_steps()
            before, wall = cpu_sample(), time.perf_counter()
            runs = await asyncio.gather(*(one(t, short_len, decode_tokens) for _ in range(width)))
            after, wall = cpu_sample(), time.perf_counter() - wall
            steps_after = await t.server_steps()
            stepped, decoded = steps_cpu(steps_before, steps_after), steps_cpu(steps_before, steps_after, "decode")
            per_token = statistics.median((last - first) / (n - 1) for first, last, n, _ in runs if n > 1)
            second = statistics.median(gap for *_, gap in runs)
            worker_cpu = None if stepped is None else workers_cpu_s(before, after) - stepped[0]
            decode_cpu = decoded[0] / decoded[1] if decoded and decoded[1] else None
            return StreamRun(per_token, second, serving_cpu_s(before, after), wall, sum(n for _, _, n, _ in runs),
                             width, worker_cpu, 0 if stepped is None else stepped[1], decode_cpu)
        finally:
            await t.aclose()

    engine_only = Roofline(shape, profile.model_copy(update={"token_overhead_s": 0.0, "worker_step_overhead_s": 0.0}))
    seen: dict = {}
    update: dict = {}
    idle, idle_decode = cpu_sample(), cpu_of(DECODE_TITLE)
    time.sleep(idle_s)
    idled = cpu_sample()
    idle_rate = serving_cpu_s(idle, idled) / idle_s  # Ray's and Redis's own polling, the OS
    workers_idle_rate = workers_cpu_s(idle, idled) / idle_s  # their actors' and Ray's own polling
    decode_idle_rate = (cpu_of(DECODE_TITLE) - idle_decode) / idle_s  # its actor's own polling
    def decode_step_s(width: int) -> float:
        """The engine's own decode step of `width` streams' batch: timed now, or the profile's."""
        if timer is not None:
            return statistics.mean(timer.decode(width, 4))
        return engine_only.step_s(StepWork.of([(1, short_len + decode_tokens // 2, True)] * width))

    def prefill_step_s(new: int, cached: int) -> float:
        if timer is not None:
            return statistics.mean(timer.prefill(new, cached) for _ in range(3))
        return roofline.step_s(StepWork.of([(new, cached, True)]))

    # One stream and `streams` at once, in interleaved rounds (the machine's speed drifts):
    # what a served worker's decode step costs beyond the engine's, per step and per token.
    widths = (1, 1, 1, streams) * stream_rounds
    steps, runs = [], []
    for w in widths:
        steps.append(decode_step_s(w))
        runs.append(asyncio.run(streaming(w)))
    beyond = {}
    for width in (1, streams):
        per_token = statistics.mean(r.per_token_s for w, r in zip(widths, runs) if w == width)
        step = statistics.mean(t for w, t in zip(widths, steps) if w == width)
        beyond[width] = per_token - step
        seen[f"time_per_token_{width}_streams_s"], seen[f"decode_step_{width}_s"] = per_token, step
    per_step, per_seq = _step_and_token_overheads(beyond[1], beyond[streams], streams)
    prefix = "decode_" if disaggregated else ""  # a disaggregated fleet's decode worker has its own
    update[f"{prefix}token_overhead_s"], update[f"{prefix}worker_step_overhead_s"] = per_seq, per_step
    if disaggregated:
        # The first token comes from the prefill worker; the second waits for the router's call to
        # the decode actor, its push request, the KV pull and the admit between steps, then a step.
        second = statistics.mean(r.second_gap_s for w, r in zip(widths, runs) if w == 1)
        update["decode_admit_overhead_s"] = max(0.0, second - seen["time_per_token_1_streams_s"])
        seen["second_token_gap_1_stream_s"] = second
    cpu, wall = sum(r.cpu_s for r in runs), sum(r.wall_s for r in runs)
    tokens, requests_n = sum(r.tokens for r in runs), sum(r.requests for r in runs)
    seen |= {"serving_cpu_s": cpu, "streaming_wall_s": wall, "streamed_tokens": tokens, "idle_cpu_rate": idle_rate,
             "worker_idle_cpu_rate": workers_idle_rate, "idle_workers": len(idled.workers)}
    # A served step's stepping thread is all of its compute with one torch thread only
    # (engine/step_log.py): with more, the other threads' share would land in the workers' own.
    worker_cpu = None
    if timer is not None and timer.threads == 1:
        worker_cpu = worker_stream_cpu_s(runs, workers_idle_rate, per_step, per_seq)
        seen |= {"worker_stream_cpu_s": worker_cpu}
    if not disaggregated:
        profile = profile.model_copy(update=update)
    roofline = Roofline(shape, profile)
    lens = (short_len,) if disaggregated else (short_len, long_len)
    cached = {n: 0 if n == short_len else (n - 1) // block_size * block_size for n in lens}  # a hit runs >= 1
    steps_s = {n: prefill_step_s(n - c, c) for n, c in cached.items()}
    measured = asyncio.run(ttfts({n: bool(c) for n, c in cached.items()}))
    over = {n: measured[n] - steps_s[n] for n in lens}
    seen |= {f"median_ttft_{n}_s": measured[n] for n in lens}
    if disaggregated:
        base = profile.request_overhead_s + profile.request_overhead_per_token_s * short_len
        update["handoff_overhead_s"] = max(0.0, over[short_len] - base)
        profile = profile.model_copy(update=update)
        if profile.host_cores:
            per_request = {n: asyncio.run(decode_cpu(n)) for n in (short_len, long_len)}
            busy = {n: cpu - decode_idle_rate * wall for n, (cpu, wall) in per_request.items()}
            receive = max(0.0, (busy[long_len] - busy[short_len]) / (long_len - short_len))
            profile = profile.model_copy(update={"kv_receive_cpu_per_token_s": receive})
            seen |= {"decode_idle_cpu_rate": decode_idle_rate} | {
                f"decode_cpu_per_request_{n}_s": cpu for n, (cpu, _) in per_request.items()}
            scene = HitScene(shape.name, corun_width, hit_len=long_len, short_len=short_len, block_size=block_size,
                             phases=corun_phases)
            widths = (0, corun_width, corun_wide_width) if corun_wide_width > corun_width else (0, corun_width)
            ttfts = {width: ([], [], []) for width in widths}
            paces: list[StreamGaps] = []
            for _ in range(rounds):  # interleaved: the machine's speed drifts
                for width, kinds in ttfts.items():
                    got, pace = asyncio.run(hits_beside(width, scene))
                    for seen_s, more in zip(kinds, got):
                        seen_s += more
                    if pace is not None and width == corun_width:
                        paces.append(pace)
            alone, beside, *wide = (HitTtfts.of(v) for v in ttfts.values())
            handoff, sim_alone = handoff_to_match(profile, scene, alone)
            seen |= {"handoff_from_cold_s": profile.handoff_overhead_s,
                     "simulated_alone_at_that_short_s": sim_alone.short_s,
                     "simulated_alone_at_that_long_s": sim_alone.long_s}
            profile, fit_seen = fit_corun(profile.model_copy(update={"handoff_overhead_s": handoff}), scene, alone,
                                          beside)
            profile, span_seen = fit_corun_span(profile, scene, alone, beside)  # the scene above has cold hits
            fit_seen |= span_seen | {"cold_hit_alone_s": alone.cold_s,
                                     f"cold_hit_beside_{corun_width}_s": beside.cold_s}
            if wide:
                profile, wide_seen = fit_wait_per_answer(profile, scene, corun_wide_width, alone, wide[0])
                fit_seen |= wide_seen | {f"hit_beside_{corun_wide_width}_s": wide[0].short_s,
                                         f"long_hit_beside_{corun_wide_width}_s": wide[0].long_s}
            if paces:
                profile, decode_seen = fit_decode_corun(profile, scene, StreamGaps.mean(paces))
                fit_seen |= decode_seen
            else:  # decode_corun_slowdown stays as it was
                fit_seen["decode_fit_skipped"] = "the scene's answer ended before the hits in every round"
            # Each fit above moved the figures the others had matched: refine them together.
            profile, joint_seen = refine_jointly(profile, scene, alone, beside, corun_wide_width if wide else None,
                                                 wide[0] if wide else None, StreamGaps.mean(paces) if paces else None)
            fit_seen |= joint_seen
            # The short lone hits' only: the simulator times every step as its fit, so their
            # spread is the serving path's; the long hits' holds their 96 more tokens' step noise
            # too (quartiles -4.0 and +4.6 ms about their median against the short's -2.8 and
            # +2.1; pooled, 1P+1D's simulated lone hits at 1 req/s spread to +11 ms at their 90th
            # percentile where the validation's hits of 32 new tokens spread to +7).
            profile = profile.model_copy(update={"request_jitter_s": jitter_quantiles(ttfts[0][0])})
            seen["jitter_long_s"] = jitter_quantiles(ttfts[0][1], points=5)
            seen |= {"hit_alone_s": alone.short_s, f"hit_beside_{corun_width}_s": beside.short_s,
                     "long_hit_alone_s": alone.long_s, f"long_hit_beside_{corun_width}_s": beside.long_s} | fit_seen
        return profile, seen | {"steal_share": stolen.share()}
    slope = max(0.0, (over[long_len] - over[short_len]) / (long_len - short_len))
    update["request_overhead_per_token_s"] = slope
    update["request_overhead_s"] = max(0.0, over[short_len] - slope * short_len)
    profile = profile.model_copy(update=update)
    # What the streaming cost the machine beside the worker, less its requests' way in.
    requests_s = requests_n * (profile.request_overhead_s + profile.request_overhead_per_token_s * short_len)
    outside = (cpu - idle_rate * wall - requests_s) / max(1, tokens)
    seen["outside_stream_cpu_s"] = outside
    update["stream_cpu_s"] = max(0.0, outside + max(0.0, worker_cpu or 0.0))
    cores = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if profile.host_cores is None:  # an engine fit sets it (a core per torch thread of a step)
        update["host_cores"] = cores
    # What the serve keeps busy idle, in the host's slots (a core per torch thread of a step)
    slots = (profile.host_cores or cores) / cores
    update["background_cores"] = max(0.0, idle_rate) * slots
    update["worker_background_cores"] = max(0.0, workers_idle_rate) / max(1, len(idled.workers)) * slots
    if timer is not None:  # a CPU host: what its idle costs the next step and the next request
        engine_s, served_s = asyncio.run(engine_after_idle()), asyncio.run(served_after_idle())
        update["cold_step_s"], update["cold_request_s"] = cold_tables(engine_s, served_s)
        seen |= {"decode_step_after_idle_s": engine_s, "ttft_after_idle_s": served_s}
    if timer is not None and timer.threads == 1 and all(r.decode_step_cpu_s for r in runs):
        # What a served decode step's CPU grows by with another engine stepping beside it (one
        # answer each way, interleaved): the cores oversubscribed, as two workers' answers are.
        beside = EngineBeside(timer.preset, timer.dtype, context=short_len + decode_tokens // 2)
        try:
            paired: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(oversubscribed_rounds):
                for busy in (False, True):
                    with beside.stepping() if busy else nullcontext():
                        paired[busy].append(asyncio.run(streaming(1)).decode_step_cpu_s or 0.0)
        finally:
            beside.close()
        alone_cpu, beside_cpu = (statistics.median(paired[b]) for b in (False, True))
        update["oversubscribed_slowdown"] = max(1.0, beside_cpu / alone_cpu) if alone_cpu > 0 else 1.0
        seen |= {"served_decode_step_cpu_alone_s": alone_cpu, "served_decode_step_cpu_beside_s": beside_cpu}
    return profile.model_copy(update=update), seen | {"steal_share": stolen.share()}
