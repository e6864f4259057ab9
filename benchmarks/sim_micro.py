"""The simulator's interactions one at a time: small scenes run on a real `brigade serve`
(1 prefill + 1 decode worker, the `bench` preset) and simulated on this machine's profile,
so a validation miss in sim_bench can be traced to the interaction the model gets wrong.

Scenes (each prefix hit: the shared 512-token system prompt plus 32 new tokens):
- hit_beside_N: a hit's TTFT while N long streams decode (N = 0..3): the decode worker's
  steps, the reservation waiting for the step in flight, the host's cores shared.
- hit_after_hit: a hit sent the moment another hit's first token arrives (that one's KV
  then moves to the decode worker while this one prefills).
- tpot_beside_N: those streams' time per token meanwhile (the decode worker's served step).
The scenes are measured again (up to 3 times) while the hypervisor takes more than 5% of the
CPU time meanwhile (steal, cluster/steal.py); raw.steal_share is the kept try's.
Ratios: micro_error_<scene> = |simulated - measured| / measured (the hits' median TTFT, the
streams' mean time per token).

Examples:
  python benchmarks/sim_micro.py                       # calibrate here first (about 5 minutes in all)
  python benchmarks/sim_micro.py --profile P.json      # a profile `brigade sim calibrate` wrote
  python benchmarks/sim_micro.py --quick --profile P.json   # N in {0, 3}, 4 hits each
"""
from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "client"))

from _sim_validate import Fleet, calibrate_here, fleet_config, least_stolen, serve  # noqa: E402

from benchmarks._common import RESULTS_DIR, machine_info, print_ratios, write_result  # noqa: E402

MODEL, NUM_BLOCKS = "bench", 1024
FLEET = Fleet("1p1d", "disaggregated", 1, 1)
SYSTEM_LEN, QUESTION_LEN, STREAM_LEN = 512, 32, 1500


def _prompts(seed: int):
    rng = random.Random(seed)
    system = [rng.randrange(3, 4000) for _ in range(SYSTEM_LEN)]
    return system, lambda n=QUESTION_LEN: [rng.randrange(3, 4000) for _ in range(n)]


async def _ttft(client, prompt: list[int], max_tokens: int, first: asyncio.Future | None = None,
                tokens_at: list[float] | None = None) -> float:
    """The request's TTFT; `first` gets it as it comes, `tokens_at` each token's arrival."""
    sent, ttft = time.perf_counter(), None
    async for chunk in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0):
        if ttft is None and chunk.token_ids:
            ttft = time.perf_counter() - sent
            if first is not None:
                first.set_result(ttft)
        if tokens_at is not None:
            tokens_at.extend([time.perf_counter()] * len(chunk.token_ids))
    return ttft


def _time_per_token(streams: list[list[float]], since: float, until: float) -> float:
    """The streams' mean time between tokens within [since, until]."""
    gaps = []
    for at in streams:
        inside = [t for t in at if since <= t <= until]
        if len(inside) > 1:
            gaps.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.mean(gaps)


async def _measure(target: str, streams: list[int], hits: int, seed: int = 0) -> dict[str, float]:
    """The scenes on the serve at `target`; a try of another `seed` shares no prompt with the last."""
    from brigade_client.aio import AsyncClient

    system, fresh = _prompts(seed)
    out = {}
    async with AsyncClient(target) as client:
        await _ttft(client, system + fresh(), 2)  # the system prompt cached
        for n in streams:
            at: list[list[float]] = [[] for _ in range(n)]
            bg = [asyncio.create_task(_ttft(client, fresh(SYSTEM_LEN + QUESTION_LEN), STREAM_LEN, tokens_at=a))
                  for a in at]
            await asyncio.sleep(5.0 if n else 0.5)  # past their prefills: decoding
            ttfts, since = [], time.perf_counter()
            for _ in range(hits):
                ttfts.append(await _ttft(client, system + fresh(), 2))
                await asyncio.sleep(0.5)
            if n:
                out[f"tpot_beside_{n}"] = _time_per_token(at, since, time.perf_counter())
            for t in bg:
                t.cancel()
            await asyncio.gather(*bg, return_exceptions=True)
            out[f"hit_beside_{n}"] = statistics.median(ttfts)
        pairs = []
        for _ in range(hits):
            first = asyncio.get_running_loop().create_future()
            a = asyncio.create_task(_ttft(client, system + fresh(), 32, first))
            await first
            pairs.append(await _ttft(client, system + fresh(), 32))
            await a
            await asyncio.sleep(0.5)
        out["hit_after_hit"] = statistics.median(pairs)
    return out


def _simulate(profile: Path, streams: list[int], hits: int) -> dict[str, float]:
    from sim.fleet import SimSession, simulate

    cfg = fleet_config(FLEET, MODEL, profile, NUM_BLOCKS)
    system, fresh = _prompts(0)
    warm = SimSession("warm", 0.0, ((system + fresh(), 2),))

    def ttft(run: dict, session: str) -> float:
        return next(r.ttft_s for r in run["records"] if r.session_id == session)

    out = {}
    for n in streams:
        bg = [SimSession(f"bg{i}", 1.0, ((fresh(SYSTEM_LEN + QUESTION_LEN), STREAM_LEN),)) for i in range(n)]
        # one after another, as measured: each sent 0.5 s after the last one's answer (about 0.6 s apart)
        shots = [SimSession(f"hit{k}", 6.0 + 0.6 * k, ((system + fresh(), 2),)) for k in range(hits)]
        run = simulate(cfg, [warm, *bg, *shots])
        out[f"hit_beside_{n}"] = statistics.median(ttft(run, f"hit{k}") for k in range(hits))
        if n:
            at = [[r.start_s + t for t, k in zip(r.chunk_times_s, r.chunk_tokens) for _ in range(k)]
                  for r in run["records"] if r.session_id.startswith("bg")]
            out[f"tpot_beside_{n}"] = _time_per_token(at, 6.0, 6.0 + 0.6 * hits)
    alone = ttft(simulate(cfg, [warm, SimSession("A", 3.0, ((system + fresh(), 32),))]), "A")
    pair = [warm, SimSession("A", 3.0, ((system + fresh(), 32),)),
            SimSession("B", 3.0 + alone, ((system + fresh(), 32),))]
    out["hit_after_hit"] = ttft(simulate(cfg, pair), "B")
    return out


def _grpc_target(serve_out: Path) -> str:
    """host:port of the gRPC server from serve's ready line (the SDK's clients speak gRPC)."""
    return next(m.group(1) for ln in serve_out.read_text().splitlines() if (m := re.search(r"grpc://(\S+)", ln)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, help="a profile from `brigade sim calibrate` (default: calibrate "
                    "here as sim_bench does: the engine with 1 torch thread, then the serving path on a "
                    "1-worker colocated and a 1P+1D serve)")
    ap.add_argument("--quick", action="store_true", help="0 and 3 streams, 4 hits a scene "
                    "(about a minute with --profile)")
    args = ap.parse_args()
    streams, hits = ([0, 3], 4) if args.quick else ([0, 1, 2, 3], 8)
    out_dir = RESULTS_DIR / "sim_micro.d"
    log_dir = out_dir / "logs"
    profile = args.profile
    if profile is None:
        profile = out_dir / "this-machine.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        calibrate_here(MODEL, NUM_BLOCKS, profile, log_dir / "calibrate")
    with serve(FLEET, MODEL, NUM_BLOCKS, log_dir):
        scenes = ", ".join(f"hit_beside_{n}" for n in streams)
        print(f"measuring {scenes}, hit_after_hit ({hits} hits each)", flush=True)
        target = _grpc_target(log_dir / f"{FLEET.name}.serve.out")
        seeds = iter(range(1000))
        measured, stolen = least_stolen(lambda: asyncio.run(_measure(target, streams, hits, next(seeds))),
                                        "the scenes")
    simulated = _simulate(profile, streams, hits)
    ratios = {f"micro_error_{k}": abs(simulated[k] - m) / m for k, m in measured.items()}
    targets = {k: "<= 0.15" for k in ratios}
    for k, m in measured.items():
        print(f"  {k:15s} measured {m * 1e3:6.1f} ms  simulated {simulated[k] * 1e3:6.1f} ms")
    print_ratios(ratios, targets, "simulated vs measured, one interaction at a time")
    raw = {"measured_s": measured, "simulated_s": simulated, "steal_share": stolen, "profile": str(profile),
           "hits": hits, "streams": streams, "stream_len": STREAM_LEN, "model": MODEL, "num_blocks": NUM_BLOCKS}
    path = write_result("sim_micro.quick" if args.quick else "sim_micro", machine_info(), ratios, targets, raw)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
