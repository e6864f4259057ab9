"""`brigade sim calibrate --url/--disagg-url`: the serving path's costs beyond the engine's
steps, measured on a running `brigade serve` with loadtest's HTTP target (so it lives at the
edge: sim/ imports only engine and router), into a device profile's request_overhead_s,
request_overhead_per_token_s, token_overhead_s and handoff_overhead_s."""
from __future__ import annotations

import asyncio
import statistics
import time

from loadtest.targets import TargetConfig, make_target
from loadtest.types import Message, Prompt
from sim.cost import Roofline, StepWork
from sim.hardware import DeviceProfile
from sim.shapes import ModelShape


def measure_serving(url: str, profile: DeviceProfile, shape: ModelShape, disaggregated: bool = False,
                    requests: int = 8, short_len: int = 4, long_len: int = 512, decode_tokens: int = 48,
                    streams: int = 4) -> tuple[DeviceProfile, dict]:
    """The serving path's costs on a running `brigade serve` at `url` (of the preset the profile
    was fitted on), through loadtest's HTTP target as `brigade bench` sends requests; distinct
    prompts (no prefix hit). A colocated serve gives
    - token_overhead_s: per sampled sequence per step in a served worker (its chunk's way out
      of the engine, the actor, the router and the door, which share the machine's cores with
      the engine here): `streams` concurrent `decode_tokens`-token answers, their median time
      per token less the fitted decode step of that batch, per sequence;
    - request_overhead_s + request_overhead_per_token_s * prompt tokens, once per request (the
      door, the router, the actor calls, the prompt's ids through each): the median TTFTs of
      one-token answers to `short_len`- and `long_len`-token prompts, one at a time, less their
      prefill steps, as a line through the two.
    A disaggregated one (`disaggregated`, measured after the colocated one) gives
    handoff_overhead_s: what its short TTFT holds beyond that (the decode worker's reservation
    and the prefill worker's answer, actor calls the simulated network does not time).
    The profile with them set, and what was seen."""
    ids = iter(range(10**9))

    async def one(target, prompt_len: int, max_tokens: int) -> tuple[float, float, int]:
        i = next(ids)
        tokens = [101 + (7 * i + 13 * j) % 997 for j in range(prompt_len)]
        prompt = Prompt(f"calibrate-{i}", "calibrate", (Message("user", tokens),), max_tokens)
        sent = time.perf_counter()
        chunks = [c async for c in target.stream(prompt) if c.num_tokens]
        return chunks[0].time - sent, chunks[-1].time - sent, sum(c.num_tokens for c in chunks)

    async def ttft(prompt_len: int) -> float:
        target = make_target(TargetConfig(url=url, ignore_eos=True, return_token_ids=True, timeout_s=120))
        try:
            for _ in range(2):  # warm the path up
                await one(target, prompt_len, 1)
            return statistics.median([(await one(target, prompt_len, 1))[0] for _ in range(requests)])
        finally:
            await target.aclose()

    async def per_token() -> float:
        target = make_target(TargetConfig(url=url, ignore_eos=True, return_token_ids=True, timeout_s=120))
        try:
            await one(target, short_len, 4)
            runs = await asyncio.gather(*(one(target, short_len, decode_tokens) for _ in range(streams)))
            return statistics.median((last - first) / (n - 1) for first, last, n in runs if n > 1)
        finally:
            await target.aclose()

    roofline = Roofline(shape, profile)
    seen: dict = {}
    update: dict = {}
    if not disaggregated:
        t = asyncio.run(per_token())
        step = roofline.step_s(StepWork.of([(1, short_len + decode_tokens // 2, True)] * streams))
        update["token_overhead_s"] = max(0.0, (t - step) / streams)
        seen |= {"median_time_per_token_s": t, "decode_step_s": step, "streams": streams}
        profile = profile.model_copy(update=update)
        roofline = Roofline(shape, profile)
    lens = (short_len,) if disaggregated else (short_len, long_len)
    over = {}
    for n in lens:
        measured = asyncio.run(ttft(n))
        over[n] = measured - roofline.step_s(StepWork.of([(n, 0, True)]))
        seen[f"median_ttft_{n}_s"] = measured
    if disaggregated:
        base = profile.request_overhead_s + profile.request_overhead_per_token_s * short_len
        update["handoff_overhead_s"] = max(0.0, over[short_len] - base)
    else:
        slope = max(0.0, (over[long_len] - over[short_len]) / (long_len - short_len))
        update["request_overhead_per_token_s"] = slope
        update["request_overhead_s"] = max(0.0, over[short_len] - slope * short_len)
    return profile.model_copy(update=update), seen
