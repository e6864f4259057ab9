"""The co-run costs of a CPU host (DeviceProfile.corun_wait_s, corun_slowdown and
decode_corun_slowdown, sim/cpu_host.py), fitted so that the simulator reproduces one measured
scene: prefix hits sent one at a time to a 1 prefill + 1 decode fleet, alone and while `width`
long answers stream from its decode worker. The hits alternate between two lengths of new
tokens over the same cached prefix, so their steps are short and long: a fixed wait grows both
alike, a ceiling on the step's share of a core grows the long one more; what they lose beyond a
fair share is what `fit_corun` finds. The answer loses time too: its tokens come further apart
while the hits run than before the first (`StreamGaps`), and `fit_decode_corun` finds the
ceiling on its decode steps' share that makes the simulated answer lose as much. `brigade sim
calibrate --disagg-url` measures the scene (cluster/serving_costs.py) and calls both."""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from engine.config import SchedulerConfig
from router.config import RouterConfig
from sim.fleet import FleetConfig, SimSession, simulate
from sim.hardware import DeviceProfile


@dataclass(frozen=True)
class HitScene:
    """The scene as measured: `hits` requests `spacing_s` apart (2 tokens each, so each
    reserves on the decode worker as a real answer does), beside `width` answers of
    `stream_len` tokens to distinct `short_len`-token prompts that began `settle_s` before the
    first hit. The hits take turns by kind: a short one is one `hit_len`-token prompt (cached
    before: its full blocks are hits, the rest is computed); a long one those cached blocks and
    `long_new` tokens of its own (a longer step over the same prefix); where `cold`, a cold one
    `hit_len` tokens no other prompt has (a whole prompt's step, where corun_span_s shows). The
    answer's tokens from `quiet_from_s` after it was sent to the first hit are its pace alone
    (past its admission), those from the first hit to the last one's answer its pace beside them."""

    model: str
    width: int
    hits: int = 15
    hit_len: int = 516
    long_new: int = 96
    short_len: int = 4
    stream_len: int = 1000
    cold: bool = True
    spacing_s: float = 0.4
    settle_s: float = 1.5
    quiet_from_s: float = 0.3
    block_size: int = 16
    # Simulated `phases` times, each hit later by a golden-ratio share of `phase_window_s` (a
    # decode step or so), and the medians taken over all: real hits land at any phase of the
    # decode worker's steps, but a scene simulated once locks them to the steps, and its growth
    # jumped by up to 15 ms between neighbouring points of fit_corun's grid.
    phases: int = 3
    phase_window_s: float = 0.03

    def hit_prompt(self) -> list[int]:
        return [101 + 13 * j % 997 for j in range(self.hit_len)]

    def long_prompt(self, hit: list[int], k: int, salt: int = 0) -> list[int]:
        """The `k`-th long hit: the hit's cached blocks, then `long_new` tokens no other has."""
        cached = (self.hit_len - 1) // self.block_size * self.block_size
        return hit[:cached] + [100 + (3001 + 17 * k + 31 * salt + j) % 3900 for j in range(self.long_new)]

    def cold_prompt(self, k: int, salt: int = 0) -> list[int]:
        """The `k`-th cold hit: `hit_len` tokens of its own (its first block differs from every
        other prompt's, so none of its blocks is cached)."""
        return [100 + (7001 + 41 * k + 43 * salt + 11 * j) % 3900 for j in range(self.hit_len)]

    def kind(self, k: int) -> int:
        """Hit k's kind: 0 short, 1 long, 2 cold."""
        return k % (3 if self.cold else 2)

    def prompt(self, hit: list[int], k: int, salt: int = 0, first: int | None = None) -> list[int]:
        """Hit k's prompt (`first`: a cold prompt's first token, where given)."""
        kind = self.kind(k)
        if kind < 2:
            return self.long_prompt(hit, k, salt) if kind else hit
        cold = self.cold_prompt(k, salt)
        return cold if first is None else [first] + cold[1:]


class HitTtfts(NamedTuple):
    """The median TTFT of a scene's hits of each kind (cold: None in a scene without)."""

    short_s: float
    long_s: float
    cold_s: float | None = None

    @classmethod
    def of(cls, samples: tuple[list[float], ...]) -> HitTtfts:
        """The medians of each kind's TTFTs (an empty list: none of that kind)."""
        return cls(*(statistics.median(v) if v else None for v in samples))

    def over(self, base: HitTtfts) -> HitTtfts:
        """Each kind's growth over `base`."""
        cold = None if self.cold_s is None or base.cold_s is None else self.cold_s - base.cold_s
        return HitTtfts(self.short_s - base.short_s, self.long_s - base.long_s, cold)

    def miss(self, want: HitTtfts, cold: bool = False) -> float:
        """The squared distance to `want`: the fits' least squares over the short and the long
        hits (and the cold ones, where `cold`)."""
        out = (self.short_s - want.short_s) ** 2 + (self.long_s - want.long_s) ** 2
        if cold and self.cold_s is not None and want.cold_s is not None:
            out += (self.cold_s - want.cold_s) ** 2
        return out


class StreamGaps(NamedTuple):
    """An answer's mean time between tokens before the scene's first hit and while they run."""

    quiet_s: float
    beside_s: float

    @property
    def ratio(self) -> float:
        return self.beside_s / self.quiet_s

    @classmethod
    def of(cls, times: list[float], sent: float, first_hit: float, last_answer: float, scene: HitScene) -> StreamGaps:
        """From an answer's token times (on one clock with `sent`, the first hit's send and the
        last hit's answer)."""
        def mean_gap(start: float, end: float) -> float:
            inside = [t for t in times if start <= t <= end]
            if len(inside) < 2:
                raise ValueError(f"the answer streamed {len(inside)} tokens in the scene's window "
                                 f"{start - sent:.2f}-{end - sent:.2f} s: too few to time its pace")
            return (inside[-1] - inside[0]) / (len(inside) - 1)

        return cls(mean_gap(sent + scene.quiet_from_s, first_hit), mean_gap(first_hit, last_answer))

    @classmethod
    def mean(cls, paces: list[StreamGaps]) -> StreamGaps:
        """Each gap's mean over several scenes' (or phases')."""
        return cls(*(statistics.mean(p[i] for p in paces) for i in range(2)))


def hit_ttfts(profile: DeviceProfile, scene: HitScene, width: int | None = None) -> HitTtfts:
    """The scene's simulated median TTFTs (beside `width` streams; None: the scene's), over
    its phases."""
    return simulate_scene(profile, scene, scene.width if width is None else width)[0]


def stream_gaps(profile: DeviceProfile, scene: HitScene) -> StreamGaps | None:
    """The scene's first answer's simulated pace alone and beside the hits, means over its phases
    (None where it ended before the hits: a model that fast needs a longer answer to time)."""
    if scene.width < 1:
        raise ValueError("a scene of no answer streams none to time")
    return simulate_scene(profile, scene, scene.width)[1]


def simulate_scene(profile: DeviceProfile, scene: HitScene, width: int) -> tuple[HitTtfts, StreamGaps | None]:
    """The scene beside `width` answers, simulated: its hits' median TTFTs by kind, and its first
    answer's pace (None without one, or where it ended before the hits), over its phases."""
    hit = scene.hit_prompt()
    # Only the hits' times change from phase to phase.
    around = [SimSession("warm", 0.0, ((hit, 2),))]
    around += [SimSession(f"stream{i}", 0.5, (([7919 * (i + 1) + j for j in range(scene.short_len)],
                                                scene.stream_len),)) for i in range(width)]
    prompts = [scene.prompt(hit, k) for k in range(scene.hits)]
    first = 0.5 + scene.settle_s
    kinds: tuple[list[float], ...] = ([], [], [])
    gaps: list[StreamGaps] = []
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "profile.json"
        # Medians compared across a grid of profiles: each request at its median (no jitter).
        path.write_text(profile.model_copy(update={"request_jitter_s": ()}).model_dump_json())
        cfg = FleetConfig(model=scene.model, device=str(path), link="gloo-loopback", block_size=scene.block_size,
                          scheduler=SchedulerConfig(), router=RouterConfig(), stream_every=1)
        for phase in range(scene.phases):
            sessions = around + [SimSession(f"hit{k}", first + k * scene.spacing_s + _phase(phase, k, scene),
                                            ((prompt, 2),)) for k, prompt in enumerate(prompts)]
            records = {r.session_id: r for r in simulate(cfg, sessions)["records"]}
            for k in range(scene.hits):
                kinds[scene.kind(k)].append(records[f"hit{k}"].ttft_s)
            if width:
                answer = records["stream0"]
                # to the latest hit's answer, as measured (a hit behind a slow cold one may end last)
                last = max(records[f"hit{k}"].start_s + records[f"hit{k}"].e2e_s for k in range(scene.hits))
                try:
                    gaps.append(StreamGaps.of([answer.start_s + t for t in answer.chunk_times_s], answer.start_s,
                                              records["hit0"].start_s, last, scene))
                except ValueError:  # the answer ended before the hits
                    pass
    return HitTtfts.of(kinds), StreamGaps.mean(gaps) if gaps else None


def _phase(phase: int, k: int, scene: HitScene) -> float:
    """Hit k's delay in the `phase`-th simulation, within the scene's window: golden-ratio
    steps cover it evenly for any number of hits (phase 0 keeps the first hit on time)."""
    return scene.phase_window_s * (((phase * scene.hits + k) * 0.6180339887498949) % 1.0)


def handoff_to_match(profile: DeviceProfile, scene: HitScene, alone: HitTtfts) -> tuple[float, HitTtfts]:
    """The handoff_overhead_s with which the scene's lone hits, simulated, take what they were
    measured to (the mean of the short and the long hits' misses added to the profile's, at
    least 0), and the simulated lone hits it started from. The scene's lone hits are measured on
    the same serve and in the same minutes as what the fit compares them with; the handoff
    taken from a cold prompt's TTFT against the colocated serve's request overhead is a
    difference of medians from two serves at two moments: it was 0.0 in one calibration where
    these lone hits said 8.6 and 2.3 ms, and 0.0 and 1.1 ms in two more where this gave 18.2
    and 18.4 (re-simulated with the cold prompt's, the first of those runs' disaggregated p50
    TTFTs were 24-43% low; with this one, 2-25%)."""
    sim = hit_ttfts(profile, scene, width=0)
    grown = alone.over(sim)
    miss = (grown.short_s + grown.long_s) / 2  # the cold hits' step holds the engine fit's noise
    return max(0.0, profile.handoff_overhead_s + miss), sim


def jitter_quantiles(*samples: list[float], points: int = 11) -> tuple[float, ...]:
    """DeviceProfile.request_jitter_s from lone requests' TTFTs: each list's samples less its
    own median (requests of one kind), pooled, at `points` evenly spaced probabilities from 0
    to 1 (the least, the quantiles between, the most)."""
    spread = sorted(x - statistics.median(v) for v in samples if v for x in v)
    if len(spread) < 2:
        return ()
    inner = statistics.quantiles(spread, n=points - 1, method="inclusive")
    return (spread[0], *inner, spread[-1])


# The grid fit_corun searches. The growths move in steps with either, not smoothly: a hit's
# reservation waits for the decode worker's step in flight, so its own step starts in lockstep
# with the decode steps, and a wait a few ms longer can move it past one step's end (on this
# machine's profile and a 1.3 ceiling, the short hits' growth went 31, 22, 49, 57 ms at waits
# of 0, 5, 10 and 15 ms); a bisection stopped at such a step, 16 ms short of the growth measured.
# The scene's phases smooth the steps, not away (on another profile, at waits of 0 to 15 ms in
# 2.5 ms steps: 21, 24, 31, 30, 34, 40, 42 ms at one phase, 18, 22, 27, 29, 34, 39, 41 at three).
SLOWDOWNS = (1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2.0, 2.25, 2.5, 3.0, 3.5, 4.0)
WAITS_S = tuple(0.0025 * i for i in range(21))  # 0 to 50 ms


def fit_corun(profile: DeviceProfile, scene: HitScene, alone: HitTtfts, beside: HitTtfts,
              slowdowns: tuple[float, ...] = SLOWDOWNS, waits_s: tuple[float, ...] = WAITS_S
              ) -> tuple[DeviceProfile, dict]:
    """The corun_slowdown and corun_wait_s, of `slowdowns` x `waits_s`, whose simulated scene
    grows the hits' TTFTs beside the streams nearest to what was measured (the differences, so a
    bias of a hit's own cost cancels; least squares over the short and the long hits: a wait
    grows both alike, a slowdown the long ones more). The profile with them set, and what was
    seen. `at_bound` says the measured growth is more than the grid's largest can explain: the
    scene was not the one modelled (a machine whose speed changed between the rounds, or one
    too loaded to serve it), so the fit should not be trusted."""
    sim_alone = hit_ttfts(profile, scene, width=0)
    want = beside.over(alone)

    def growth(slowdown: float, wait_s: float) -> HitTtfts:
        terms = {"corun_slowdown": slowdown, "corun_wait_s": wait_s, "corun_span_s": None}
        return hit_ttfts(profile.model_copy(update=terms), scene).over(sim_alone)

    grid = {(s, w): growth(s, w) for s in slowdowns for w in waits_s}
    (slowdown, wait_s), fitted = min(grid.items(), key=lambda kv: kv[1].miss(want))
    most = grid[(max(slowdowns), max(waits_s))]
    at_bound = want.short_s > most.short_s or want.long_s > most.long_s
    none = grid.get((1.0, 0.0)) or growth(1.0, 0.0)
    return profile.model_copy(update={"corun_slowdown": slowdown, "corun_wait_s": wait_s, "corun_span_s": None}), {
        "measured_growth_short_s": want.short_s, "measured_growth_long_s": want.long_s,
        "simulated_growth_short_s": fitted.short_s, "simulated_growth_long_s": fitted.long_s,
        "simulated_alone_short_s": sim_alone.short_s, "simulated_alone_long_s": sim_alone.long_s,
        "growth_at_none_short_s": none.short_s, "growth_at_none_long_s": none.long_s,
        "at_bound": at_bound}


# The spans fit_corun_span tries (None: the whole step).
SPANS_S = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, None)


def fit_corun_span(profile: DeviceProfile, scene: HitScene, alone: HitTtfts, beside: HitTtfts,
                   spans_s: tuple[float | None, ...] = SPANS_S) -> tuple[DeviceProfile, dict]:
    """The corun_span_s, of `spans_s`, whose scene simulated beside its answers grows the hits
    nearest to what was measured, least squares over all three kinds (a span short enough to
    spare the cold prompts' step spares the long hits' too, where they must not be); run after
    fit_corun, on its wait and ceiling, which the short and long hits alone pin. A hit's growth
    is part fixed, part its step's, but not all of a long step's: in stop 45's two runs a 1P+1D
    cold 512-token prompt beside one answer grew 60-85 ms over its lone TTFT of 250-280, where
    the ceilings fitted on hits of 4 and 96 new tokens (1.4 and 1.3) gave it 95-115 (and the
    1P+1D p90 TTFT at 4 req/s, made of such prompts, 0.20 high in one of them). The profile
    with it set, and what was seen."""
    if alone.cold_s is None or beside.cold_s is None:
        raise ValueError("the span is fitted on a scene's cold hits: this scene has none")
    sim_alone = hit_ttfts(profile, scene, width=0)
    want = beside.over(alone)
    grid = {s: hit_ttfts(profile.model_copy(update={"corun_span_s": s}), scene).over(sim_alone) for s in spans_s}
    # The whole step first: a span that changes nothing (one past every step's end) is no span.
    best = min(sorted(grid, key=lambda s: s is not None), key=lambda s: grid[s].miss(want, cold=True))
    whole = grid[None] if None in grid else hit_ttfts(profile.model_copy(update={"corun_span_s": None}),
                                                          scene).over(sim_alone)
    return profile.model_copy(update={"corun_span_s": best}), {
        "measured_growth_cold_s": want.cold_s, "simulated_growth_cold_s": grid[best].cold_s,
        "growth_cold_over_the_whole_step_s": whole.cold_s, "simulated_alone_cold_s": sim_alone.cold_s}


# The waits fit_wait_per_answer tries for each answer beyond the first.
WAITS_PER_ANSWER_S = tuple(0.001 * i for i in range(21))  # 0 to 20 ms


def fit_wait_per_answer(profile: DeviceProfile, scene: HitScene, width: int, alone: HitTtfts, beside: HitTtfts,
                        waits_s: tuple[float, ...] = WAITS_PER_ANSWER_S) -> tuple[DeviceProfile, dict]:
    """The corun_wait_per_answer_s, of `waits_s`, whose scene simulated beside `width` (> 1)
    answers grows the hits' TTFTs nearest to what was measured beside them (least squares over
    the short and the long hits, as fit_corun; run after it, on its wait and ceiling). Measured
    per request in stop 44's recorded run, 1P+1D hits grew about 23 ms beside one answer and
    7-8 ms more per answer after it, most of which sharing the cores gives them; a wait of
    fit_corun's 10 ms for each answer put those beside three 21-28 ms high. Two calibrations
    on one serve fitted 0 and 7 ms. The profile with it set, and what was seen
    (`wide_at_bound`: the growth measured is more than the grid's largest wait gives)."""
    if width < 2:
        raise ValueError(f"a wait per answer beyond the first needs a scene of 2 or more, not {width}")
    sim_alone = hit_ttfts(profile, scene, width=0)
    want = beside.over(alone)
    grid = {w: hit_ttfts(profile.model_copy(update={"corun_wait_per_answer_s": w}), scene, width).over(sim_alone)
            for w in waits_s}
    best = min(grid, key=lambda w: grid[w].miss(want))
    most = grid[max(waits_s)]
    return profile.model_copy(update={"corun_wait_per_answer_s": best}), {
        f"measured_growth_{width}_short_s": want.short_s, f"measured_growth_{width}_long_s": want.long_s,
        f"simulated_growth_{width}_short_s": grid[best].short_s, f"simulated_growth_{width}_long_s": grid[best].long_s,
        f"growth_{width}_at_no_extra_short_s": grid[min(waits_s)].short_s,
        f"growth_{width}_at_no_extra_long_s": grid[min(waits_s)].long_s,
        "wide_at_bound": want.short_s > most.short_s or want.long_s > most.long_s}


# The ceilings fit_decode_corun tries on an answer's decode steps beside a prompt step.
DECODE_SLOWDOWNS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0)


def fit_decode_corun(profile: DeviceProfile, scene: HitScene, measured: StreamGaps,
                     slowdowns: tuple[float, ...] = DECODE_SLOWDOWNS) -> tuple[DeviceProfile, dict]:
    """The decode_corun_slowdown, of `slowdowns`, whose simulated scene slows its answer's pace
    beside the hits (against its own pace before them: a ratio, so the engine's and the serving
    path's speed that minute cancel) nearest to what was measured. On the 2-core machine here
    the answer's tokens came 1.06-1.12x further apart beside the hits than before them (five
    calibrations), simulated 1.05-1.06x without it; and the validation's 1P+1D answers were
    simulated 5-14% low while a prompt ran beside them, in every try of stop 43's recorded run.
    The profile with it set, and what was seen; the profile as it was where the simulated answer
    ends before the hits (a model too fast for the scene's answer)."""
    paces = {k: stream_gaps(profile.model_copy(update={"decode_corun_slowdown": k}), scene) for k in slowdowns}
    if any(p is None for p in paces.values()):
        return profile, {"decode_fit_skipped": "the simulated answer ended before the scene's hits"}
    grid = {k: p.ratio for k, p in paces.items()}
    best = min(grid, key=lambda k: abs(grid[k] - measured.ratio))
    return profile.model_copy(update={"decode_corun_slowdown": best}), {
        "measured_answer_gap_quiet_s": measured.quiet_s, "measured_answer_gap_beside_s": measured.beside_s,
        "measured_answer_slowdown": measured.ratio, "simulated_answer_slowdown": grid[best],
        "simulated_answer_slowdown_at_none": grid.get(1.0),
        "decode_at_bound": measured.ratio > grid[max(slowdowns)]}
