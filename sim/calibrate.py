"""`brigade sim calibrate`: a "this machine" device profile fitted from short measured runs of
the real engine.

Measured: prefill steps (one prompt of n tokens, compute-bound) and decode steps (b sequences
of context c, memory-bound: a decode step does 0.5 flop per weight byte per sequence in float32,
1 in bfloat16, so b stays below the machine's flops/byte ridge) of an engine preset, each the
median of a few repeats, in the dtype `brigade serve` would pick here ("auto": bfloat16 where
the CPU multiplies it in hardware), so the profile describes the workers it predicts. Fitted
by least squares, sharing one per-step overhead (sim/cost.py's roofline with efficiencies 1):

    prefill: t = flops / peak_flops + overhead        decode: t = bytes / mem_bw + overhead

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
        mem_bytes: float = 8e9) -> tuple[DeviceProfile, dict]:
    """The profile whose roofline best explains the samples, and each sample's relative error."""
    unit = DeviceProfile(name="unit", peak_flops=1.0, mem_bw=1.0, mem_bytes=1e30, dtype_bytes=dtype_bytes)
    r = Roofline(shape, unit)
    rows = [[r.flops(s.work), 0.0, 1.0] if s.kind == "prefill" else [0.0, r.bytes(s.work), 1.0] for s in samples]
    y = np.array([s.seconds for s in samples])
    a = np.array(rows)
    weights = 1 / y  # relative error, so the short decode steps count as much as long prefills
    inv_flops, inv_bw, overhead = np.linalg.lstsq(a * weights[:, None], y * weights, rcond=None)[0]
    if overhead < 0:
        # A negative per-step time is noise in the prefill samples' intercept (decode steps of a
        # small batch read nearly the same bytes, so they cannot pin it); clamping it afterwards
        # would leave the bandwidth fitted against it, and every decode step predicted too slow
        # by the lost intercept. Fit again with no overhead instead.
        (inv_flops, inv_bw), overhead = np.linalg.lstsq(a[:, :2] * weights[:, None], y * weights, rcond=None)[0], 0.0
    if inv_flops <= 0 or inv_bw <= 0:
        raise ValueError("the measured steps do not fit a roofline (noisy machine?); run calibrate again")
    profile = DeviceProfile(name=name, peak_flops=1 / inv_flops, mem_bw=1 / inv_bw, mem_bytes=mem_bytes,
                            step_overhead_s=max(0.0, float(overhead)), dtype_bytes=dtype_bytes,
                            intra_link="gloo-loopback", inter_link="gloo-loopback")
    fitted = Roofline(shape, profile)
    errors = [{"kind": s.kind, "tokens": s.work.tokens, "measured_s": s.seconds,
               "predicted_s": fitted.step_s(s.work), "error": fitted.step_s(s.work) / s.seconds - 1}
              for s in samples]
    return profile, {"samples": errors, "max_abs_error": max(abs(e["error"]) for e in errors)}


def measure(preset: str = "bench", prefill_lens: tuple[int, ...] = (256, 512, 1024),
            decode_batches: tuple[int, ...] = (1, 2, 4), context: int = 256, repeats: int = 3,
            threads: int | None = None, dtype: str = "auto") -> tuple[ModelShape, list[Sample], int]:
    """Time the real engine's steps on this machine (CPU, `dtype`); the samples and the bytes
    per element of the dtype the engine ran in."""
    import torch

    from engine.config import CacheConfig, EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.presets import PRESETS
    from engine.sampling import SamplingParams

    if threads:
        torch.set_num_threads(threads)
    cfg = EngineConfig(model=preset, device="cpu", dtype=dtype,
                       cache=CacheConfig(num_blocks=4096, enable_prefix_cache=False))
    engine = LLMEngine(cfg)
    shape = ModelShape.from_config(preset, PRESETS[preset].config)
    samples: list[Sample] = []
    n_id = iter(range(10**9))

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start

    for n in prefill_lens:
        times = []
        for _ in range(repeats + 1):  # the first is a warm-up
            engine.add_request(f"p{next(n_id)}", [7 + (i % 1000) for i in range(n)], SamplingParams(max_tokens=1))
            times.append(timed_step())
        samples.append(Sample("prefill", StepWork.of([(n, 0, True)]), statistics.median(times[1:])))
    for b in decode_batches:
        for i in range(b):
            engine.add_request(f"d{next(n_id)}", [11 + (i + j) % 1000 for j in range(context)],
                               SamplingParams(max_tokens=repeats + 3, ignore_eos=True))
        while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()  # the prompts
        engine.step()  # a warm-up decode step
        times = [timed_step() for _ in range(repeats)]
        samples.append(Sample("decode", StepWork.of([(1, context + 2, True)] * b), statistics.median(times)))
        while engine.has_unfinished():
            engine.step()
    return shape, samples, engine.dtype.itemsize

