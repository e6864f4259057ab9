"""The co-run terms refined together on the whole measured scene (sim/corun.py).

sim/corun.py fits the terms one after another, each on the figure it moves most: the wait and
the ceiling on the hits beside one answer, the span on the cold hits, the wait per answer on the
hits beside three, the decode ceiling on the answer's pace. But each term moves the others'
figures too: a decode step that gets less of a core holds its worker longer, so the hits that
wait for it grow. Fitted last, the decode ceiling undid the hits' fit: in two calibrations of
stop 51 the profile each wrote grew the scene's short hits beside one answer 22.5 ms where
measured 16.3 and fitted 17.0 (a 1.75 ceiling), and those beside three 23.0 / 29.9 ms (short /
long) where measured 26.4 / 26.0 (3.0). `refine_jointly` starts where the one-by-one fits ended
and moves one term at a time to whichever of its grid's values makes the whole scene nearest
(`SceneFit.miss`), until no term moves: the miss can only fall, so it stops, and the profile it
writes reproduces the scene it was fitted on at least as well as the one-by-one fits' did."""
from __future__ import annotations

from dataclasses import dataclass

from sim.corun import (
    DECODE_SLOWDOWNS,
    SLOWDOWNS,
    SPANS_S,
    WAITS_PER_ANSWER_S,
    WAITS_S,
    HitScene,
    HitTtfts,
    StreamGaps,
    simulate_scene,
)
from sim.hardware import DeviceProfile

# How much an answer's pace counts beside the hits' growth: a ratio off by 0.01 weighs as a hit
# 2 ms off. Two calibrations an hour apart measured the pace 1.118 and 1.136 and the hits' growth
# 2-5 ms apart: this weighs each figure by about its own spread between measurements.
PACE_WEIGHT_S = 0.2


@dataclass(frozen=True)
class SceneFit:
    """The scene's figures, measured or simulated: the hits' growth over their lone TTFTs beside
    one answer (short, long, cold) and beside `wide` answers (short, long; None: not measured),
    and the first answer's pace beside the hits over before them (None: not measured)."""

    one: HitTtfts
    wide: HitTtfts | None = None
    pace: float | None = None

    def miss(self, want: SceneFit) -> float:
        """The squared distance to `want` over every figure both have."""
        out = self.one.miss(want.one, cold=True)
        if self.wide is not None and want.wide is not None:
            out += self.wide.miss(want.wide)
        if self.pace is not None and want.pace is not None:
            out += (PACE_WEIGHT_S * (self.pace - want.pace)) ** 2
        return out


def simulated_fit(profile: DeviceProfile, scene: HitScene, sim_alone: HitTtfts, wide: int | None,
                  pace: bool) -> SceneFit:
    """The scene simulated on `profile`: the figures SceneFit holds (beside `wide` answers where
    given; the answer's pace where `pace`)."""
    one, gaps = simulate_scene(profile, scene, scene.width)
    wide_fit = simulate_scene(profile, scene, wide)[0].over(sim_alone) if wide else None
    return SceneFit(one.over(sim_alone), wide_fit, gaps.ratio if pace and gaps is not None else None)


def refine_jointly(profile: DeviceProfile, scene: HitScene, alone: HitTtfts, beside: HitTtfts,
                   wide_width: int | None = None, wide: HitTtfts | None = None, pace: StreamGaps | None = None,
                   sweeps: int = 3, grids: dict[str, tuple] | None = None) -> tuple[DeviceProfile, dict]:
    """The co-run terms of `profile` (the one-by-one fits' result) moved one at a time over their
    grids to make the whole scene nearest to what was measured, for up to `sweeps` passes over
    the terms (it stops at the first that moves none). The beside-`wide_width` figures and the
    decode ceiling join where measured; `grids` (term -> values) narrows the terms' grids (None:
    sim/corun.py's). The profile, and what was seen."""
    sim_alone = simulate_scene(profile, scene, 0)[0]
    want = SceneFit(beside.over(alone), wide.over(alone) if wide is not None else None,
                    pace.ratio if pace is not None else None)
    terms = {"corun_wait_s": WAITS_S, "corun_slowdown": SLOWDOWNS, "corun_span_s": SPANS_S,
             "corun_wait_per_answer_s": WAITS_PER_ANSWER_S, "decode_corun_slowdown": DECODE_SLOWDOWNS}
    terms = terms if grids is None else {k: v for k, v in grids.items() if k in terms}
    if want.wide is None:
        terms.pop("corun_wait_per_answer_s", None)
    if want.pace is None:
        terms.pop("decode_corun_slowdown", None)
    seen_fits: dict[tuple, SceneFit] = {}

    def fit_of(p: DeviceProfile) -> SceneFit:
        key = tuple(getattr(p, k) for k in terms)
        if key not in seen_fits:
            seen_fits[key] = simulated_fit(p, scene, sim_alone, wide_width if want.wide else None,
                                           want.pace is not None)
        return seen_fits[key]

    start = fit_of(profile)
    passes, moved = 0, True
    while moved and passes < sweeps:
        passes, moved = passes + 1, False
        for term, grid in terms.items():
            tried = {v: fit_of(profile.model_copy(update={term: v})).miss(want) for v in grid}
            best = min(tried, key=tried.get)
            if tried[best] < fit_of(profile).miss(want):  # strictly: ties keep the value it has
                profile, moved = profile.model_copy(update={term: best}), True
    end = fit_of(profile)
    return profile, {"joint_miss_before": start.miss(want), "joint_miss_after": end.miss(want),
                     "joint_passes": passes, "joint_simulations": len(seen_fits),
                     "joint_growth_short_s": end.one.short_s, "joint_growth_long_s": end.one.long_s,
                     "joint_growth_cold_s": end.one.cold_s,
                     **({f"joint_growth_{wide_width}_short_s": end.wide.short_s,
                         f"joint_growth_{wide_width}_long_s": end.wide.long_s} if end.wide else {}),
                     **({"joint_answer_slowdown": end.pace} if end.pace is not None else {})}
