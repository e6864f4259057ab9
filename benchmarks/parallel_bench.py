"""Tensor-parallel decode and heterogeneous-TP KV transfer on this machine (CPU, gloo).

Ratios, each against a baseline measured in the same run on the same cores:

  tp2_step_vs_tp1_b1, tp2_step_vs_tp1_b32   (recorded; no target on a 2-core CPU box)
      Median decode step time of an engine split over 2 ranks (two processes, 1 torch thread
      each, gloo) divided by one engine with 2 threads, at batch 1 and 32. Each request has a
      `prompt_len`-token prompt, prefilled before timing; then `steps` pure decode steps are
      timed on rank 0 (engine.step(): the batch broadcast, the forward with its all-reduces
      and all-gather, sampling). Below 1.0 means TP=2 is faster.
  tp2_comm_fraction_b1, tp2_comm_fraction_b32   (recorded)
      The share of rank 0's step time spent inside the group's collectives (the op broadcast,
      2 all-reduces per layer, the embedding all-reduce and the logits all-gather), waiting
      for the other rank included.
  hetero_transfer_vs_same_tp   (target <= 1.2)
      The time to move one request's KV (`transfer_tokens` tokens, the model's layout, fp32)
      from a TP=1 prefill process to a TP=2 decode group (two receiver processes, each taking
      exactly its KV heads over its own pair, both pairs in flight at once, then writing
      them into its pool) divided by TP=1 -> TP=1 (one receiver taking all heads). Time per
      rep = the last receiver's end minus the sender's start (wall clocks of one host);
      median over reps.

The model: the `bench` preset (Qwen3: 8/2 heads; random weights), not SmolLM2-135M, the other
benchmarks' default: SmolLM2's 9 attention heads and 3 KV heads do not split over the 2 ranks
measured here (TP=3 would split them, but 3 ranks on a 2-core machine measure contention, not
tensor parallelism). `--model NAME|PATH` takes any model whose head counts divide by 2.

Output: benchmarks/results/parallel_bench.json; --quick (tiny preset, fewer steps and a
256-token transfer, < 1 minute) writes parallel_bench.quick.json. A missed target prints MISS
and exits 0. Numbers are meaningful only on a quiet machine (raw.machine_load records the
load). NCCL on a GPU machine needs two GPUs for TP=2; not run here.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args

NAME = "parallel_bench"
TARGETS = {"hetero_transfer_vs_same_tp": "<= 1.2"}
WHY_NOT_SMOLLM2 = ("SmolLM2-135M's 9 attention heads / 3 KV heads do not split over TP=2 "
                   "(TP=3 would, but 3 ranks on 2 cores measure contention)")
FULL = dict(model="bench", batches=[1, 32], prompt_len=128, warmup=3, steps=20, transfer_tokens=1024, reps=10,
            num_blocks=1024)
QUICK = dict(model="tiny", batches=[1, 32], prompt_len=32, warmup=2, steps=6, transfer_tokens=256, reps=3,
             num_blocks=512)


def _spawn(args: dict) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(args.get("threads", 1))}
    return subprocess.Popen([sys.executable, "-m", "benchmarks._parallel_rank", json.dumps(args)], cwd=C.ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs: list[subprocess.Popen], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.returncode not in (None, 0) for p in procs):
            break
        time.sleep(0.1)
    for p in procs:
        if p.poll() is None:
            p.kill()
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("a rank failed:\n" + "\n---\n".join(log[-3000:] for log in logs))


def decode_steps(plan: dict, tp: int, tmp: Path) -> dict:
    out = tmp / f"step-tp{tp}.json"
    threads = 2 if tp == 1 else 1  # the same two cores either way
    procs = [_spawn({**{k: plan[k] for k in ("model", "batches", "prompt_len", "warmup", "steps", "num_blocks")},
                     "mode": "step", "tp": tp, "rank": r, "threads": threads, "out": str(out),
                     "rendezvous": f"file://{tmp}/store-tp{tp}"}) for r in range(tp)]
    _finish(procs)
    return json.loads(out.read_text())


def transfer(plan: dict, dst_tp: int, tmp: Path) -> list[float]:
    d = tmp / f"xfer-{dst_tp}"
    d.mkdir()
    common = {"model": plan["model"], "tokens": plan["transfer_tokens"], "reps": plan["reps"], "dst_tp": dst_tp,
              "dir": str(d)}
    procs = [_spawn({**common, "mode": "recv", "rank": r, "out": str(d / f"recv{r}.json")}) for r in range(dst_tp)]
    procs.append(_spawn({**common, "mode": "send", "out": str(d / "send.json")}))
    _finish(procs)
    starts = json.loads((d / "send.json").read_text())
    ends = [json.loads((d / f"recv{r}.json").read_text()) for r in range(dst_tp)]
    return [max(e[i] for e in ends) - s for i, s in enumerate(starts)]


def phase_decode(plan: dict, tmp: Path) -> tuple[dict, dict]:
    """Decode steps at TP=1 and TP=2; the raw record and the ratios per batch size."""
    tp1, tp2 = decode_steps(plan, 1, tmp), decode_steps(plan, 2, tmp)
    raw, ratios = {"tp1": tp1, "tp2": tp2}, {}
    for b in plan["batches"]:
        one, two = tp1[str(b)], tp2[str(b)]
        ratios[f"tp2_step_vs_tp1_b{b}"] = statistics.median(two["step_s"]) / statistics.median(one["step_s"])
        ratios[f"tp2_comm_fraction_b{b}"] = sum(two["comm_s"]) / sum(two["step_s"])
        raw[f"median_step_ms_b{b}"] = {"tp1": 1e3 * statistics.median(one["step_s"]),
                                       "tp2": 1e3 * statistics.median(two["step_s"])}
    return raw, ratios


def phase_transfer(plan: dict, tmp: Path) -> dict:
    same, hetero = transfer(plan, 1, tmp), transfer(plan, 2, tmp)
    return {"tp1_to_tp1_s": same, "tp1_to_tp2_s": hetero}


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "smoke run (< 1 minute), writes parallel_bench.quick.json", model="bench",
                    why=WHY_NOT_SMOLLM2)
    ap.set_defaults(model=None)  # bench, or tiny with --quick (the plan's)
    args = ap.parse_args(argv)
    run = BenchRun(NAME, TARGETS, args, keep_going=True)  # a failed phase is recorded; the other still runs
    plan = run.plan(FULL, QUICK, model=args.model)
    model_info = C.prepare_model(plan["model"])
    if model_info["num_heads"] % 2 or model_info["num_kv_heads"] % 2:
        ap.error(f"{plan['model']} has {model_info['num_heads']} attention heads and {model_info['num_kv_heads']} "
                 "KV heads: TP=2 needs both even; pick another --model (default: bench)")
    ratios: dict = {}
    with tempfile.TemporaryDirectory(prefix="parallel-bench-") as tmp:
        decode, ratios = run.phase("decode", phase_decode, plan, Path(tmp)) or ({}, {})
        hetero = run.phase("transfer", phase_transfer, plan, Path(tmp))
    if hetero:
        ratios["hetero_transfer_vs_same_tp"] = (statistics.median(hetero["tp1_to_tp2_s"])
                                                / statistics.median(hetero["tp1_to_tp1_s"]))
    return run.finish(ratios, model_info=model_info, why_not_smollm2=WHY_NOT_SMOLLM2, decode=decode or None,
                      transfer=hetero)


if __name__ == "__main__":
    sys.exit(main())
