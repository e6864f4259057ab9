"""`brigade sim calibrate`: a device profile of this machine, fitted from the real engine's steps.

Measured (sim/step_timer.py): prefill steps (one prompt of n tokens), prefills after a cached
prefix (a prefix hit's step) and decode steps (b sequences of context c) of an engine preset,
greedy as `brigade bench` asks, each the mean of interleaved rounds (so every kind sees the
same mix of the machine's quiet and busy moments), in the dtype `brigade serve` would pick
here ("auto": bfloat16 where the CPU multiplies it in hardware). Fitted by least squares on
sim/cost.py's roofline with efficiencies 1, sharing one per-step and one per-sampled-sequence
overhead, each step on the side of the roofline the fit itself puts it:

    compute-bound: t = matmul flops / peak_flops + attention flops / (peak_flops * attn_eff)
                       + decode attention flops / (peak_flops * decode_attn_eff)
                       + own attention flops / (peak_flops * prompt_attn_eff) + step + seq * b
    memory-bound:  t = bytes / mem_bw + step + seq * b

The three attention rates are told apart by the samples: prefills over cached prefixes pin the
rate over the context (attn_eff), decode batches at two contexts a decode's (decode_attn_eff),
fresh prompts of three lengths or more a prompt's among its own tokens (prompt_attn_eff).

Where a machine's flops/byte ridge is low (float32 on a slow core), decode batches of 2 and
more are compute-bound; fitting them as bytes would fold their flops into the per-sequence
overhead, and the roofline, which adds the compute time, would count them twice. So the fit
refits with each step on the side the fitted roofline puts it until that no longer changes,
from two starts (every decode step memory-bound, and every step compute-bound: a decode step's
bytes and the per-step time trade off, and where the fit settles depends on where it starts),
and keeps the better. The profile is what `--device FILE.json` takes; the fit's residuals are
in its report.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from sim.cost import Roofline, StepWork
from sim.hardware import DeviceProfile
from sim.shapes import ModelShape

# A fit that misses a measured step by more than this explains nothing (steps measured while
# the machine was busy, or out of order): refused, to be measured again.
MAX_MISFIT = 0.5


@dataclass(frozen=True)
class Sample:
    kind: str  # "prefill" | "decode"
    work: StepWork
    seconds: float


def fit(shape: ModelShape, samples: list[Sample], dtype_bytes: int, name: str = "this-machine",
        mem_bytes: float = 8e9) -> tuple[DeviceProfile, dict]:
    """The profile whose roofline best explains the samples, and each sample's relative error."""
    unit = DeviceProfile(name="unit", peak_flops=1.0, mem_bw=1.0, mem_bytes=1e30, dtype_bytes=dtype_bytes)
    r = Roofline(shape, unit)
    # Attention apart from the matmuls only where enough prefills (of several lengths and
    # cached contexts) tell them apart; otherwise it runs at their rate.
    apart = sum(s.kind == "prefill" for s in samples) >= 4
    # And a decode batch's attention apart from a hit's where decode steps at two contexts
    # tell it apart; otherwise it runs at the hits' rate.
    dec_apart = len({s.work.kv_tokens // max(1, s.work.tokens) for s in samples if s.kind == "decode"}) >= 2
    # And a fresh prompt's attention among its own tokens apart from its matmuls where fresh
    # prompts of three lengths or more tell the quadratic part apart.
    self_apart = len({s.work.tokens for s in samples if s.kind == "prefill" and not s.work.ctx_pairs}) >= 3
    y = np.array([s.seconds for s in samples])
    weights = 1 / y  # relative error, so the short decode steps count as much as long prefills

    def row(w: StepWork, compute_bound: bool) -> list[float]:
        # Columns: s/flop of the matmuls, of a hit's attention and of a decode's, s/byte, s per
        # step, s per sampled sequence, s/flop of a fresh prompt's attention among its own tokens.
        if not compute_bound:
            return [0.0, 0.0, 0.0, r.bytes(w), 1.0, w.sampled, 0.0]
        dec = r.decode_attn_flops(w) if dec_apart else 0.0
        attn = (r.attn_flops(w) - dec) if apart else 0.0
        own = r.prompt_attn_flops(w) if self_apart else 0.0
        return [r.flops(w) - attn - dec - own, attn, dec, 0.0, 1.0, w.sampled, own]

    def solve(compute_bound: list[bool]) -> DeviceProfile:
        a = np.array([row(s.work, bound) for s, bound in zip(samples, compute_bound)])
        unused = {k for k, off in ((1, not apart), (2, not dec_apart), (3, all(compute_bound)), (6, not self_apart))
                  if off}
        keep = [k for k in range(7) if k not in unused]
        while True:
            x = np.linalg.lstsq(a[:, keep] * weights[:, None], y * weights, rcond=None)[0]
            coef = dict(zip(keep, x))
            # A negative per-step or per-sequence time is noise in an intercept the samples barely
            # pin (decode steps of a small batch read nearly the same bytes); clamping it afterwards
            # would leave the rest fitted against it, and every step predicted off by the lost
            # part. Fit again without it instead.
            # (A fresh prompt's own attention faster than free is the same noise.)
            negative = [k for k in (5, 4, 6) if k in coef and coef[k] < 0]
            if not negative and coef.get(3, 1.0) <= 0 < coef[0] and 4 in keep:
                # Decode steps read nearly the same bytes at every batch, so their bytes term and the
                # per-step term trade off: a large prefill intercept can leave the bytes none. The
                # per-step time goes then (a decode step is then its bytes and its sequences).
                negative = [4]
            if not negative:
                break
            keep.remove(negative[0])
        inv_flops, inv_attn = coef[0], coef.get(1, coef[0])
        if inv_flops <= 0:
            raise ValueError("the measured steps do not fit a roofline (noisy machine?); run calibrate again")
        if 3 in coef:
            inv_bw = coef[3]
        else:  # every step compute-bound: the bytes are read at least as fast as the steps compute
            # (a hair faster than that: at the tie, rounding decided the side, and it differed by CPU)
            inv_bw = min(r.flops(s.work) * inv_flops / r.bytes(s.work) for s in samples) * (1 - 1e-9)
        if inv_bw <= 0:
            raise ValueError("the measured steps do not fit a roofline (noisy machine?); run calibrate again")
        # Attention at the matmuls' rate or below (faster would be noise: samples without much of it).
        attn_eff = min(1.0, inv_flops / inv_attn) if inv_attn > 0 else 1.0
        prompt_attn_eff = min(1.0, inv_flops / coef[6]) if coef.get(6, 0.0) > 0 else 1.0
        decode_attn_eff = None
        if dec_apart:
            decode_attn_eff = min(1.0, inv_flops / coef[2]) if coef[2] > 0 else 1.0
        return DeviceProfile(name=name, peak_flops=1 / inv_flops, mem_bw=1 / inv_bw, mem_bytes=mem_bytes,
                             attn_eff=attn_eff, decode_attn_eff=decode_attn_eff, prompt_attn_eff=prompt_attn_eff,
                             step_overhead_s=float(coef.get(4, 0.0)), seq_overhead_s=float(coef.get(5, 0.0)),
                             dtype_bytes=dtype_bytes, intra_link="gloo-loopback", inter_link="gloo-loopback")

    def settle(bound: list[bool]) -> DeviceProfile:
        for _ in range(8):  # a side that flips moves the fit a little; it settles in two or three
            profile = solve(bound)
            sides = [Roofline(shape, profile).compute_bound(s.work) for s in samples]
            if sides == bound:
                break
            bound = sides
        return profile

    def misfit(profile: DeviceProfile) -> float:
        r = Roofline(shape, profile)
        return sum((r.step_s(s.work) / s.seconds - 1) ** 2 for s in samples)

    # Decode steps read nearly the same bytes at every batch, so their bytes and the per-step
    # time trade off, and where the fit settles depends on where it starts (a unit test keeps
    # measured steps that settle badly from one start). Both starts, and the better fit.
    settled, refused = [], None
    for start in ([s.kind == "prefill" for s in samples], [True] * len(samples)):
        try:
            settled.append(settle(start))
        except ValueError as exc:
            refused = exc
    if not settled:
        raise refused
    profile = min(settled, key=misfit)
    fitted = Roofline(shape, profile)
    errors = [{"kind": s.kind, "tokens": s.work.tokens, "context": s.work.kv_tokens - s.work.tokens,
               "measured_s": s.seconds, "predicted_s": fitted.step_s(s.work),
               "error": fitted.step_s(s.work) / s.seconds - 1}
              for s in samples]
    worst = max(abs(e["error"]) for e in errors)
    if worst > MAX_MISFIT:
        raise ValueError(f"the measured steps do not fit a roofline (a step off by {worst:.0%}: noisy machine?); "
                         "run calibrate again")
    return profile, {"samples": errors, "max_abs_error": worst}


def measure(preset: str = "bench", prefill_lens: tuple[int, ...] = (64, 256, 512, 1024),
            extends: tuple[tuple[int, int], ...] = ((32, 512), (128, 512), (32, 1024)),
            decode_batches: tuple[int, ...] = (1, 2, 4, 8), context: int = 256,
            long_decode_batches: tuple[int, ...] = (1, 2, 4, 8), long_context: int = 1024, rounds: int = 8,
            decode_steps: int = 4, threads: int | None = None,
            dtype: str = "auto") -> tuple[ModelShape, list[Sample], int]:
    """Time the real engine's steps on this machine (CPU, `dtype`; sim/step_timer.py); the samples
    and the bytes per element of the dtype the engine ran in. Prefills of fresh prompts
    (`prefill_lens`) and of (new, cached) tokens after a cached prefix (`extends`: a prefix hit's
    step, where attention over the context is much of the work), and decode steps of `decode_batches`
    sequences of `context` tokens and of `long_decode_batches` of `long_context` (a decode batch's
    attention over its contexts, at its own rate).

    A shared machine's speed drifts by a quarter within seconds (other tenants), so the kinds
    are measured in `rounds` interleaved rounds, each timing every prefill length once and
    `decode_steps` steps of every decode batch: each kind sees the same mix of quiet and busy
    moments, and each sample is its kind's mean (the simulator predicts means, and a busy
    moment is as real in a served run as a quiet one)."""
    from engine.presets import PRESETS
    from sim.step_timer import StepTimer

    shape = ModelShape.from_config(preset, PRESETS[preset].config)
    # A batch's first sequences decode while its last ones' prompts fill in: budget for those steps too.
    timer = StepTimer(preset, dtype, context, decode_budget=(rounds + 1) * decode_steps + 64, threads=threads)
    steps = [(n, 0) for n in prefill_lens] + list(extends)
    prefill_s: dict[tuple[int, int], list[float]] = {step: [] for step in steps}
    decodes = [(b, context) for b in decode_batches] + [(b, long_context) for b in long_decode_batches]
    decode_s: dict[tuple[int, int], list[float]] = {d: [] for d in decodes}
    for r in range(rounds + 1):  # the first round is a warm-up (and caches the prefixes)
        for new, ctx in steps:
            t = timer.prefill(new, ctx)
            if r:
                prefill_s[(new, ctx)].append(t)
        for b, c in decodes:
            times = timer.decode(b, decode_steps, c)
            if r:
                decode_s[(b, c)] += times
    samples = [Sample("prefill", StepWork.of([(new, ctx, True)]), statistics.mean(prefill_s[(new, ctx)]))
               for new, ctx in steps]
    half = 1 + (rounds + 1) * decode_steps // 2  # the context grows by this halfway through the timed steps
    samples += [Sample("decode", StepWork.of([(1, c + half, True)] * b), statistics.mean(decode_s[(b, c)]))
                for b, c in decodes]
    return shape, samples, timer.dtype_bytes
