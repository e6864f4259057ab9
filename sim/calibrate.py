"""`brigade sim calibrate`: a "this machine" device profile fitted from short measured runs of
the real engine.

Measured: prefill steps (one prompt of n tokens, compute-bound) and decode steps (b sequences
of context c) of an engine preset, each the mean of interleaved rounds, in the dtype `brigade
serve` would pick here ("auto": bfloat16 where the CPU multiplies it in hardware), so the
profile describes the workers it predicts. Fitted by least squares, sharing one per-step and
one per-sampled-sequence overhead (sim/cost.py's roofline with efficiencies 1; prefills after a
cached prefix tell attention's rate apart), each step on the side of the roofline the fit
itself puts it:

    compute-bound: t = matmul flops / peak_flops + attention flops / (peak_flops * attn_eff) + step + seq * b
    memory-bound:  t = bytes / mem_bw + step + seq * b

A decode step does 0.5 flop per weight byte per sequence in float32 (1 in bfloat16), so where
the machine's flops/byte ridge is low (float32 on a slow AVX2 core: 25 GFLOP/s against 47 GB/s)
its batches of 2 and more are compute-bound; fitting them as bytes would fold their flops into
the per-sequence overhead, and the roofline, which adds the compute time, would count them
twice (a batch of 8 predicted 29% slow). So the fit starts with every decode step memory-bound,
then refits with each step on the side the fitted roofline puts it until that no longer
changes. (A CPU engine's decode step grows with the batch far beyond its flops: sampling and
each sequence's bookkeeping and attention call cost about a millisecond apiece here.)

The profile is what `--device FILE.json` takes; the fit's own residuals are in its report.
The serving path's costs beyond the engine's steps (request_overhead_s and the rest) are
measured on a running `brigade serve` by cluster/serving_costs.py (`calibrate --url`).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from sim.cost import Roofline, StepWork
from sim.hardware import DeviceProfile
from sim.shapes import ModelShape


@dataclass(frozen=True)
class Sample:
    kind: str  # "prefill" | "decode"
    work: StepWork
    seconds: float


def fit(shape: ModelShape, samples: list[Sample], dtype_bytes: int, name: str = "this-machine",
        mem_bytes: float = 8e9, host_cores: float | None = None) -> tuple[DeviceProfile, dict]:
    """The profile whose roofline best explains the samples, and each sample's relative error.
    `host_cores`: how many such steps the machine runs at once (sim/cpu_host.py)."""
    unit = DeviceProfile(name="unit", peak_flops=1.0, mem_bw=1.0, mem_bytes=1e30, dtype_bytes=dtype_bytes)
    r = Roofline(shape, unit)
    # Attention apart from the matmuls only where enough prefills (of several lengths and
    # cached contexts) tell them apart; otherwise it runs at their rate.
    apart = sum(s.kind == "prefill" for s in samples) >= 4
    y = np.array([s.seconds for s in samples])
    weights = 1 / y  # relative error, so the short decode steps count as much as long prefills

    def solve(compute_bound: list[bool]) -> DeviceProfile:
        # Columns: s/flop of the matmuls and of attention, s/byte, s per step, s per sampled sequence.
        a = np.array([[r.flops(s.work) - apart * r.attn_flops(s.work), apart * r.attn_flops(s.work), 0.0, 1.0,
                       s.work.sampled] if bound else [0.0, 0.0, r.bytes(s.work), 1.0, s.work.sampled]
                      for s, bound in zip(samples, compute_bound)])
        keep = [k for k in (0, 1, 2, 3, 4) if (k != 1 or apart) and (k != 2 or not all(compute_bound))]
        while True:
            x = np.linalg.lstsq(a[:, keep] * weights[:, None], y * weights, rcond=None)[0]
            coef = dict(zip(keep, x))
            # A negative per-step or per-sequence time is noise in an intercept the samples barely
            # pin (decode steps of a small batch read nearly the same bytes); clamping it afterwards
            # would leave the rest fitted against it, and every step predicted off by the lost
            # part. Fit again without it instead.
            negative = [k for k in (4, 3) if k in coef and coef[k] < 0]
            if not negative and coef.get(2, 1.0) <= 0 < coef[0] and 3 in keep:
                # Decode steps read nearly the same bytes at every batch, so their bytes term and the
                # per-step term trade off: a large prefill intercept can leave the bytes none. The
                # per-step time goes then (a decode step is then its bytes and its sequences).
                negative = [3]
            if not negative:
                break
            keep.remove(negative[0])
        inv_flops, inv_attn = coef[0], coef.get(1, coef[0])
        if inv_flops <= 0:
            raise ValueError("the measured steps do not fit a roofline (noisy machine?); run calibrate again")
        if 2 in coef:
            inv_bw = coef[2]
        else:  # every step compute-bound: the bytes are read at least as fast as the steps compute
            inv_bw = min(r.flops(s.work) * inv_flops / r.bytes(s.work) for s in samples)
        if inv_bw <= 0:
            raise ValueError("the measured steps do not fit a roofline (noisy machine?); run calibrate again")
        # Attention at the matmuls' rate or below (faster would be noise: samples without much of it).
        attn_eff = min(1.0, inv_flops / inv_attn) if inv_attn > 0 else 1.0
        return DeviceProfile(name=name, peak_flops=1 / inv_flops, mem_bw=1 / inv_bw, mem_bytes=mem_bytes,
                             attn_eff=attn_eff,
                             step_overhead_s=float(coef.get(3, 0.0)), seq_overhead_s=float(coef.get(4, 0.0)),
                             dtype_bytes=dtype_bytes, intra_link="gloo-loopback", inter_link="gloo-loopback",
                             host_cores=host_cores)

    bound = [s.kind == "prefill" for s in samples]
    for _ in range(8):  # a side that flips moves the fit a little; it settles in two or three
        profile = solve(bound)
        sides = [Roofline(shape, profile).compute_bound(s.work) for s in samples]
        if sides == bound:
            break
        bound = sides
    fitted = Roofline(shape, profile)
    errors = [{"kind": s.kind, "tokens": s.work.tokens, "context": s.work.kv_tokens - s.work.tokens,
               "measured_s": s.seconds,
               "predicted_s": fitted.step_s(s.work), "error": fitted.step_s(s.work) / s.seconds - 1}
              for s in samples]
    return profile, {"samples": errors, "max_abs_error": max(abs(e["error"]) for e in errors)}


def measure(preset: str = "bench", prefill_lens: tuple[int, ...] = (64, 256, 512, 1024),
            extends: tuple[tuple[int, int], ...] = ((32, 512), (128, 512), (32, 1024)),
            decode_batches: tuple[int, ...] = (1, 2, 4, 8), context: int = 256, rounds: int = 8,
            decode_steps: int = 4, threads: int | None = None,
            dtype: str = "auto") -> tuple[ModelShape, list[Sample], int]:
    """Time the real engine's steps on this machine (CPU, `dtype`); the samples and the bytes
    per element of the dtype the engine ran in. Prefills of fresh prompts (`prefill_lens`) and
    of (new, cached) tokens after a cached prefix (`extends`: a prefix hit's step, where
    attention over the context is much of the work), and decode steps of `decode_batches`.

    A shared machine's speed drifts by a quarter within seconds (other tenants), so the kinds
    are measured in `rounds` interleaved rounds, each timing every prefill length once and
    `decode_steps` steps of every decode batch: each kind sees the same mix of quiet and busy
    moments, and each sample is its kind's mean (the simulator predicts means, and a busy
    moment is as real in a served run as a quiet one)."""
    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.presets import PRESETS
    from engine.sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)

    def new_engine(prefix_cache: bool = False) -> LLMEngine:
        return LLMEngine(EngineConfig(model=preset, device="cpu", dtype=dtype,
                                      cache=CacheConfig(num_blocks=4096, enable_prefix_cache=prefix_cache)))

    def tokens(n: int, salt: int) -> list[int]:  # distinct salts (< 1000) share no block
        return [7 + (salt * 7919 + 13 * i) % 1000 for i in range(n)]

    shape = ModelShape.from_config(preset, PRESETS[preset].config)
    n_id = iter(range(10**9))

    def timed_step(engine: LLMEngine) -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    prefiller = new_engine(prefix_cache=True)
    salts = iter(range(1, 1000))
    prefixes = {ctx: tokens(ctx, next(salts)) for ctx in dict.fromkeys(ctx for _, ctx in extends)}
    for prefix in prefixes.values():  # cached once, hit by every round's extend
        prefiller.add_request(f"c{next(n_id)}", prefix + [1], SamplingParams(max_tokens=1))
        timed_step(prefiller)
    # One engine per decode batch, its sequences kept running across the rounds.
    decoders = {b: new_engine() for b in decode_batches}
    for b, engine in decoders.items():
        for i in range(b):
            engine.add_request(f"d{next(n_id)}", [11 + (i + j) % 1000 for j in range(context)],
                               SamplingParams(max_tokens=(rounds + 1) * decode_steps + 2, ignore_eos=True))
        while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # the prompts
    prefill_s: dict[int, list[float]] = {n: [] for n in prefill_lens}
    extend_s: dict[tuple[int, int], list[float]] = {e: [] for e in extends}
    decode_s: dict[int, list[float]] = {b: [] for b in decode_batches}
    for r in range(rounds + 1):  # the first round is a warm-up
        for n in prefill_lens:
            prefiller.add_request(f"p{next(n_id)}", tokens(n, next(salts)), SamplingParams(max_tokens=1))
            t = timed_step(prefiller)
            if r:
                prefill_s[n].append(t)
        for new, ctx in extends:
            prefiller.add_request(f"e{next(n_id)}", prefixes[ctx] + tokens(new, next(salts)),
                                  SamplingParams(max_tokens=1))
            t = timed_step(prefiller)
            if r:
                extend_s[(new, ctx)].append(t)
        for b, engine in decoders.items():
            times = [timed_step(engine) for _ in range(decode_steps)]
            if r:
                decode_s[b] += times
    samples = [Sample("prefill", StepWork.of([(n, 0, True)]), statistics.mean(prefill_s[n])) for n in prefill_lens]
    samples += [Sample("prefill", StepWork.of([(new, ctx, True)]), statistics.mean(extend_s[(new, ctx)]))
                for new, ctx in extends]
    mid = context + 1 + (rounds + 1) * decode_steps // 2  # the context halfway through the timed steps
    samples += [Sample("decode", StepWork.of([(1, mid, True)] * b), statistics.mean(decode_s[b]))
                for b in decode_batches]
    return shape, samples, prefiller.dtype.itemsize
