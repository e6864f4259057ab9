"""The co-run slowdown of a CPU host (DeviceProfile.corun_slowdown, sim/cpu_host.py), fitted
so that the simulator reproduces one measured scene: prefix hits sent one at a time to a
1 prefill + 1 decode fleet, alone and while `width` long answers stream from its decode
worker. The hits' prefill steps then share the cores with the decode worker's steps; what
they lose beyond a fair share is what the fit finds. `brigade sim calibrate --disagg-url`
measures the scene (cluster/serving_costs.py) and calls `fit_corun_slowdown`."""
from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.config import SchedulerConfig
from router.config import RouterConfig
from sim.fleet import FleetConfig, SimSession, simulate
from sim.hardware import DeviceProfile


@dataclass(frozen=True)
class HitScene:
    """The scene as measured: `hits` requests of one `hit_len`-token prompt (cached before; 2
    tokens each, so each reserves on the decode worker as a real answer does), `spacing_s`
    apart, beside `width` answers of `stream_len` tokens to distinct `short_len`-token prompts
    that began `settle_s` before the first hit."""

    model: str
    width: int
    hits: int = 8
    hit_len: int = 516
    short_len: int = 4
    stream_len: int = 400
    spacing_s: float = 0.4
    settle_s: float = 1.0
    block_size: int = 16


def hit_ttft_s(profile: DeviceProfile, scene: HitScene, width: int | None = None) -> float:
    """The hits' simulated median TTFT (beside `width` streams; None: the scene's)."""
    width = scene.width if width is None else width
    hit = [101 + 13 * j % 997 for j in range(scene.hit_len)]
    sessions = [SimSession("warm", 0.0, ((hit, 2),))]
    sessions += [SimSession(f"stream{i}", 0.5, (([7919 * (i + 1) + j for j in range(scene.short_len)],
                                                  scene.stream_len),)) for i in range(width)]
    first = 0.5 + scene.settle_s
    sessions += [SimSession(f"hit{k}", first + k * scene.spacing_s, ((hit, 2),)) for k in range(scene.hits)]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "profile.json"
        path.write_text(profile.model_dump_json())
        cfg = FleetConfig(model=scene.model, device=str(path), link="gloo-loopback", block_size=scene.block_size,
                          scheduler=SchedulerConfig(), router=RouterConfig(), stream_every=1)
        run = simulate(cfg, sessions)
    return statistics.median(r.ttft_s for r in run["records"] if r.session_id.startswith("hit"))


def fit_corun_slowdown(profile: DeviceProfile, scene: HitScene, measured_alone_s: float,
                       measured_beside_s: float, most: float = 4.0) -> tuple[float, dict]:
    """The corun_slowdown (1 to `most`) whose simulated scene grows the hits' TTFT beside the
    streams by as much as measured (the difference, so a bias of the hit's own cost cancels),
    by bisection (the growth only rises with it); and what was seen. `at_bound` says the
    measured growth is more than `most` can explain: the scene was not the one modelled (a
    machine whose speed changed between the rounds, or one too loaded to serve it), so the
    fitted factor should not be trusted."""
    alone = hit_ttft_s(profile, scene, width=0)
    want = measured_beside_s - measured_alone_s

    def growth(slowdown: float) -> float:
        return hit_ttft_s(profile.model_copy(update={"corun_slowdown": slowdown}), scene) - alone

    lo, hi = 1.0, most
    if growth(lo) >= want:
        hi = lo
    elif growth(hi) <= want:
        lo = hi
    at_bound = lo == hi == most
    while hi - lo > 0.02:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if growth(mid) < want else (lo, mid)
    fitted = round((lo + hi) / 2, 3)
    return fitted, {"measured_growth_s": want, "simulated_growth_s": growth(fitted),
                    "simulated_alone_s": alone, "growth_at_1_s": growth(1.0), "at_bound": at_bound}
