"""The device check behind benchmarks/gpu_check.sh: one call on a lent GPU machine measures
what CPU tests cannot show, and writes it all to <out>/gpu_check.json.

Sections (each recorded under "raw" on its own; one that fails records its error and the rest still run):
- gpu_tests: `pytest -m gpu` over the engine, kv_transfer and HiCache tests.
- sdpa_probe: which SDPA kernels the reference attention path takes for decodes, a chunk
  with history, a prefix hit and a mixed batch, and the varlen backend's error against it.
- collective_wait: all-reduce cost on a one-rank group, waited untimed (as Group does) and
  with a timed host wait (as it did before; NCCL's host then polls with 1 ms sleeps).
- transfer_rates: the KV payload checksum and device<->host copies (pinned and pageable).
- engine: Qwen3-0.6B- and Llama-3-8B-shaped models on random weights at batch 1 and 64:
  tokens/s, GPU time vs host time per decode step, kernels per step; and LLMEngine itself
  (scheduler, sampler, detokenizer) on the `bench` preset.

--cpu-smoke runs every section on CPU with tiny shapes in seconds: CI runs it so the check
cannot rot while no device is lent. Its figures mean nothing and are marked so.
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from datetime import timedelta
from pathlib import Path

import torch

from benchmarks.harness.varlen_cases import CASES, attend, make_inputs, relative_error
from engine.model_config import ModelConfig
from engine.model_runner import ModelRunner
from engine.models import CausalLM
from engine.models.layers import RotaryEmbedding
from engine.models.varlen_attention import default_kernel, sdpa_varlen

ROOT = Path(__file__).resolve().parents[1]
GPU_TESTS = ["tests/unit/test_engine_gpu.py", "tests/unit/test_varlen_attention.py", "tests/unit/test_grouped_moe.py",
             "tests/unit/test_group_wait.py", "tests/integration/test_kv_transfer.py", "tests/unit/test_hicache.py",
             "tests/integration/test_parallel_model.py"]
SHAPES = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rope_theta=1e6, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    "llama-3-8b": dict(architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, rope_theta=5e5, max_position_embeddings=8192,
                       tie_word_embeddings=False),
}
SMOKE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
BLOCK = 16


class Plan:
    """Sizes for a real run or the CPU smoke run."""

    def __init__(self, smoke: bool):
        self.smoke = smoke
        self.device = torch.device("cpu" if smoke else "cuda")
        self.dtype = torch.float32 if smoke else torch.bfloat16
        self.batches = (1, 4) if smoke else (1, 64)
        self.prompt_len, self.steps = (8, 3) if smoke else (128, 32)
        self.collective_calls = 20 if smoke else 500
        self.payload_bytes = (1 << 20) if smoke else (256 << 20)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


# -- sections ----------------------------------------------------------------------------------

def gpu_tests(plan: Plan, tmp: Path) -> dict:
    xml = tmp / "gpu-tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    cmd += ["--collect-only"] if plan.smoke else [f"--junitxml={xml}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    lines = proc.stdout.strip().splitlines()
    out = {"returncode": proc.returncode, "summary": lines[-1] if lines else proc.stderr[-500:]}
    if xml.is_file():
        cases = ET.parse(xml).getroot().iter("testcase")
        out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in cases
                         if c.find("failure") is not None or c.find("error") is not None]
    return out


def sdpa_probe(plan: Plan) -> dict:
    """The SDPA ops our reference path calls for each case, read from the profiler."""
    kernel = sdpa_varlen if plan.smoke else default_kernel(plan.device, plan.dtype, 64)
    out = {}
    for case in CASES:
        inputs = make_inputs(case, plan.device, plan.dtype)
        ops = {}
        for name, k in (("reference", None), ("varlen", kernel)):
            if k is None and name == "varlen":
                continue
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = attend(inputs, k)
                plan.sync()
            ops[name] = sorted({e.name for e in prof.events() if "attention" in e.name and e.name.startswith("aten::")})
            if name == "reference":
                want = result
            else:
                ops["varlen_rel_err"] = relative_error(result, want)
        out[case] = ops
    return out


def collective_wait(plan: Plan, tmp: Path) -> dict:
    from engine.parallel import ParallelConfig
    from engine.parallel.group import Group

    backend = "gloo" if plan.smoke else "nccl"
    group = Group.create(ParallelConfig(rendezvous=f"file://{tmp}/store", timeout_s=60, backend=backend),
                         plan.device)
    t = torch.zeros(4096, device=plan.device)
    n = plan.collective_calls
    out = {"backend": backend, "calls": n}
    try:
        for label, step in (("untimed", lambda: group.all_reduce(t)),
                            ("timed", lambda: group.pg.allreduce([t]).wait(timedelta(seconds=60)))):
            step()
            plan.sync()
            start = time.perf_counter()
            for _ in range(n):
                step()
            host = time.perf_counter() - start
            plan.sync()
            out[f"{label}_host_us_per_call"] = host / n * 1e6
            out[f"{label}_total_us_per_call"] = (time.perf_counter() - start) / n * 1e6
    finally:
        group.close()
    return out


def transfer_rates(plan: Plan) -> dict:
    from kv_transfer.checksum import payload_checksum

    n = plan.payload_bytes
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, device=plan.device)
    algo, _ = payload_checksum(x)
    out = {"bytes": n, "checksum_algo": algo.name, "checksum_GBps": _rate(lambda: payload_checksum(x), n, plan)}
    if plan.device.type == "cuda":
        pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(n, dtype=torch.uint8)
        out["d2h_pinned_GBps"] = _rate(lambda: pinned.copy_(x, non_blocking=True), n, plan)
        out["h2d_pinned_GBps"] = _rate(lambda: x.copy_(pinned, non_blocking=True), n, plan)
        out["d2h_pageable_GBps"] = _rate(lambda: pageable.copy_(x), n, plan)
    return out


def _rate(fn, nbytes: int, plan: Plan, reps: int = 5) -> float:
    fn()
    plan.sync()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    plan.sync()
    return nbytes * reps / (time.perf_counter() - start) / 1e9


def engine_shapes(plan: Plan) -> dict:
    out = {}
    for name, hf in SHAPES.items():
        cfg = ModelConfig.from_hf(hf | SMOKE_SHAPE if plan.smoke else hf)
        model = random_model(cfg, plan)
        # The varlen backend (on CPU its SDPA stand-in) and the reference path, side by side.
        varlen = sdpa_varlen if plan.smoke else default_kernel(plan.device, plan.dtype, cfg.head_dim)
        out[name] = {f"batch_{b}_{label}": decode_speed(model, cfg, plan, b, kernel)
                     for b in plan.batches for label, kernel in (("varlen", varlen), ("reference", None))}
        del model
        if plan.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def random_model(cfg: ModelConfig, plan: Plan) -> CausalLM:
    from engine.loader import materialise

    with torch.device("meta"):
        model = CausalLM(cfg)
    model = materialise(model, plan.dtype, plan.device)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    model.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                   cfg.rope_scaling).to(plan.device)
    return model.eval()


class _Seq:
    def __init__(self, tokens: list[int], table: list[int]):
        self.token_ids, self.block_table, self.num_computed = tokens, table, 0


class _Step:
    def __init__(self, seq: _Seq, n: int):
        self.seq, self.num_new_tokens, self.samples = seq, n, True
        self.num_draft = 0  # no speculative proposals (engine.scheduler.ScheduledSeq)


def decode_speed(model: CausalLM, cfg: ModelConfig, plan: Plan, batch: int, kernel) -> dict:
    """Prefill `batch` random prompts in one step, then time greedy decode steps; attention
    through the varlen backend with `kernel`, or the reference path (None)."""
    per_seq = -(-(plan.prompt_len + plan.steps + 3) // BLOCK)
    runner = ModelRunner(model, cfg, batch * per_seq + 1, BLOCK, plan.dtype, plan.device)
    runner.varlen_kernel = kernel
    g = torch.Generator().manual_seed(batch)
    seqs = [_Seq(torch.randint(0, cfg.vocab_size, (plan.prompt_len,), generator=g).tolist(),
                 list(range(1 + i * per_seq, 1 + (i + 1) * per_seq))) for i in range(batch)]

    def step(n_of) -> float:
        """One step; returns the host seconds until the work is queued (before the sync)."""
        start = time.perf_counter()
        logits = runner.run([_Step(s, n_of(s)) for s in seqs])
        host = time.perf_counter() - start
        for s, token in zip(seqs, logits.argmax(-1).tolist()):
            s.num_computed = len(s.token_ids)
            s.token_ids.append(token)
        return host

    step(lambda s: len(s.token_ids))  # the prefill
    step(lambda s: 1)  # warm-up decode
    plan.sync()
    host_s, gpu_ms = [], []
    wall = time.perf_counter()
    for _ in range(plan.steps):
        if plan.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            host_s.append(step(lambda s: 1))
            end.record()
            end.synchronize()
            gpu_ms.append(begin.elapsed_time(end))
        else:
            host_s.append(step(lambda s: 1))
    wall = time.perf_counter() - wall
    return {"tokens_per_s": batch * plan.steps / wall, "step_ms": wall / plan.steps * 1e3,
            "host_ms_per_step": sum(host_s) / len(host_s) * 1e3,
            "gpu_ms_per_step": sum(gpu_ms) / len(gpu_ms) if gpu_ms else None,
            "attention": kernel.__name__ if kernel is not None else "reference",
            **launches_per_step(lambda: step(lambda s: 1), plan)}


def launches_per_step(fn, plan: Plan) -> dict:
    acts = [torch.profiler.ProfilerActivity.CPU]
    if plan.device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        fn()
        plan.sync()
    events = prof.events()
    if plan.device.type == "cuda":
        return {"kernels_per_step": sum(e.device_type == torch.autograd.DeviceType.CUDA for e in events)}
    return {"aten_ops_per_step": sum(e.name.startswith("aten::") for e in events)}


def engine_preset(plan: Plan) -> dict:
    """LLMEngine end to end (scheduler, sampler, detokenizer) on a preset: output tokens/s."""
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    preset = "tiny" if plan.smoke else "bench"
    engine = LLMEngine(EngineConfig(model=preset, device=plan.device.type, dtype=str(plan.dtype).split(".")[1],
                                    cache=CacheConfig(num_blocks=4096 if not plan.smoke else 256)))
    out = {"preset": preset}
    for batch in plan.batches:
        g = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, 4000, (plan.prompt_len,), generator=g).tolist() for _ in range(batch)]
        params = SamplingParams(max_tokens=plan.steps * 2, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        out[f"batch_{batch}_tokens_per_s"] = sum(len(o.token_ids) for o in outs) / wall
    return out


# -- driver ------------------------------------------------------------------------------------

def machine(plan: Plan) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "smoke": plan.smoke,
            "device": str(plan.device), "dtype": str(plan.dtype)}
    if plan.device.type == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(), "cuda": torch.version.cuda,
                 "capability": list(torch.cuda.get_device_capability())}
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json")
    ap.add_argument("--cpu-smoke", action="store_true", help="every section on CPU, tiny shapes, seconds")
    args = ap.parse_args(argv)
    plan = Plan(args.cpu_smoke)
    if not plan.smoke and not torch.cuda.is_available():
        print("no CUDA device: run with --cpu-smoke, or on a GPU machine", file=sys.stderr)
        return 2
    report: dict = {"machine": machine(plan), "raw": {}, "errors": {}, "seconds": {}}
    path = args.out / "gpu_check.json"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sections = {
            "gpu_tests": lambda: gpu_tests(plan, Path(tmp)),
            "sdpa_probe": lambda: sdpa_probe(plan),
            "collective_wait": lambda: collective_wait(plan, Path(tmp)),
            "transfer_rates": lambda: transfer_rates(plan),
            "engine_shapes": lambda: engine_shapes(plan),
            "engine_preset": lambda: engine_preset(plan),
        }
        for name, run in sections.items():
            start = time.perf_counter()
            try:
                report["raw"][name] = run()
            except Exception:  # recorded; the remaining sections still run
                report["errors"][name] = traceback.format_exc(limit=6)
            report["seconds"][name] = round(time.perf_counter() - start, 1)
            print(f"[gpu_check] {name}: {report['seconds'][name]}s", flush=True)
            # Written after every section: a run cut off by its time limit keeps what it measured.
            path.write_text(json.dumps(report | summarise(report["raw"]), indent=2) + "\n")
    print(f"[gpu_check] wrote {path}; errors in: {sorted(report['errors']) or 'none'}")
    return 0


def summarise(sections: dict) -> dict:
    """The benchmark convention's ratios and targets, from the sections that ran."""
    ratios, wait = {}, sections.get("collective_wait")
    if wait:
        timed, untimed = wait["timed_total_us_per_call"], wait["untimed_total_us_per_call"]
        ratios["collective_timed_over_untimed_wait"] = timed / untimed
    probe = sections.get("sdpa_probe") or {}
    errs = [c["varlen_rel_err"] for c in probe.values() if "varlen_rel_err" in c]
    if errs:
        ratios["varlen_max_rel_err"] = max(errs)
    return {"ratios": ratios, "targets": {"varlen_max_rel_err": "<= 0.01"}}


if __name__ == "__main__":
    sys.exit(main())
