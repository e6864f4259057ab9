"""HiCache benchmark: is loading a cached prefix back from host memory or disk really faster than
recomputing it, and what does that buy a multi-turn chat workload whose history outgrows the device pool?

All four ratios come from ONE run on SmolLM2-135M-Instruct (`smollm2-135m`: Llama, 30 layers,
hidden 576, 9/3 heads, head_dim 64; real weights, pulled and converted on first use) in float32,
with torch using every core. Blocks are 16 tokens (720 KiB of KV each on SmolLM2). `--model bench`
(Qwen3: hidden 512, 8 layers, 8/2 heads, context 4,096; random weights, 128 KiB blocks) or
`--model tiny` runs a preset instead.

  l2_ttft_vs_recompute      (target <= 0.35)
  l3_ttft_vs_recompute      (target <= 0.6)
      Time to first token of a 2,048-token prompt whose first 1,920 tokens are cached, divided by the
      TTFT of a 2,048-token prompt with nothing cached (one 2,048-token prefill step). L1 (device pool)
      is recorded too. L2: the prefix was evicted from the device pool into host memory (write-through
      copies, then the pool is drained by allocating every free block). L3: an engine with no host
      budget, so every block went through to disk; the page cache holds none of the files
      (posix_fadvise DONTNEED on each, after fsync), so the disk really is read. raw.disk says which
      device and filesystem the cache directory is on; raw.ttft.l3_page_cache_s is the same hit with
      the files in the page cache. TTFT = add_request() -> the step() that returns the token; medians.

  multiturn_throughput_on_vs_off  (target >= 1.5)
  multiturn_ttft_on_vs_off        (target <= 0.5)
      A chat workload: S sessions share a system prompt; each has its own first message, then every
      turn appends the model's reply and a new user message, so the history grows each turn. Turns go
      round-robin over the sessions, `concurrency` in flight. The device pool holds ~1/5 of the
      working set (all sessions' final histories, the system prompt counted once), so a session's
      history is evicted before its next turn. HiCache on (L2 big enough for the working set) vs off
      (device prefix cache only): output tokens/s over the whole workload, and mean TTFT. Greedy
      tokens must match between the two runs (raw.multiturn.tokens_equal).

Output: benchmarks/results/hicache_bench.json; --quick (a smoke run under a minute: a 512-token
prompt, fewer sessions and turns) writes hicache_bench.quick.json instead. A missed target prints
MISS and still exits 0. Numbers mean something only on a quiet machine (raw.phase_cpu).
"""
from __future__ import annotations

import gc
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.config import HiCacheConfig
from engine.model_config import ModelConfig
from engine.presets import resolve_model

NAME = "hicache_bench"
TARGETS = {
    "l2_ttft_vs_recompute": "<= 0.35",
    "l3_ttft_vs_recompute": "<= 0.6",
    "multiturn_throughput_on_vs_off": ">= 1.5",
    "multiturn_ttft_on_vs_off": "<= 0.5",
}
BLOCK_SIZE = 16
FIRST_ID = 3  # ids 0..2 are special tokens: keep prompts to ordinary ones


@dataclass(frozen=True)
class Plan:
    prompt_len: int = 2048
    cached_len: int = 1920
    ttft_reps: int = 3
    # 16 sessions x 6 turns; histories grow from 704 to 1,120 tokens; working set 880 blocks, pool 176.
    sessions: int = 16
    turns: int = 6
    system_len: int = 256
    first_user_len: int = 448
    user_len: int = 64
    output_len: int = 16
    concurrency: int = 2
    working_set_over_pool: float = 5.0


FULL = Plan()
# A smoke run: its working set is only ~2.3x its pool (the pool must still hold two requests).
QUICK = Plan(prompt_len=512, cached_len=480, ttft_reps=1, sessions=8, turns=3, system_len=64,
             first_user_len=32, user_len=32, output_len=4)


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def make_engine(model: str, num_blocks: int, budget: int, hicache: HiCacheConfig | None = None,
                max_num_seqs: int = 8) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, dtype="float32",
        cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE, hicache=hicache or HiCacheConfig()),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, dict]:
    """Seconds from add_request to the step that returns the first token, and where the hit came from."""
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, greedy(1))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                return time.perf_counter() - t0, dict(out.usage.cached_by_tier)


def drain_device_pool(engine: LLMEngine) -> None:
    """Evict every cached block from the device pool (the tier manager keeps them lower down)."""
    engine.pool.release(engine.pool.allocate(engine.pool.num_free))


def drop_page_cache(directory: Path) -> int:
    """Ask the kernel to forget the cached pages of every block file (clean after fsync): the next
    read goes to the device. Returns the number of files."""
    n = 0
    for path in directory.glob("*.kv"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        n += 1
    return n


def disk_info(path: Path) -> dict:
    """Which device and filesystem hold `path`, and whether the kernel calls it rotational."""
    path = path.resolve()
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if str(path).startswith(mnt.rstrip("/") + "/") or str(path) == mnt or mnt == "/":
                if len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    dev, mnt, fstype = best
    info: dict = {"path": str(path), "device": dev, "mount": mnt, "fstype": fstype}
    name = Path(dev).name
    rota = Path(f"/sys/block/{name}/queue/rotational")
    if rota.exists():
        info["rotational"] = rota.read_text().strip() == "1"
    usage = shutil.disk_usage(path)
    info.update(total_gib=round(usage.total / 2**30, 1), free_gib=round(usage.free / 2**30, 1))
    return info


# -- 1. TTFT with the prefix in L1 / L2 / L3 vs recomputed ------------------------------------
def phase_ttft(plan: Plan, model: str, seed: int, disk_dir: Path, show: bool) -> dict:
    L, P = plan.prompt_len, plan.cached_len
    pool = 2 * blocks_for(L + 1) + 8
    mem = make_engine(model, pool, budget=L, hicache=HiCacheConfig(enabled=True, host_bytes=1 << 30))
    disk = make_engine(model, pool, budget=L, hicache=HiCacheConfig(enabled=True, host_bytes=0,
                                                                     disk_dir=str(disk_dir)))
    assert L + 1 <= mem.max_model_len, f"the {model} preset's context {mem.max_model_len} is too short"
    vocab = mem.model_config.vocab_size
    rng = np.random.default_rng(seed + 1)

    def ids(n: int) -> list[int]:
        return rng.integers(FIRST_ID, vocab, size=n).tolist()

    for e in (mem, disk):
        ttft(e, "warmup", ids(L))
    out: dict = {k: [] for k in ("recompute_s", "l1_s", "l2_s", "l3_s", "l3_page_cache_s")}
    tiers: dict = {k: [] for k in ("l1", "l2", "l3", "l3_page_cache")}
    with C.progress(f"TTFT {L}-token prompt, {P} cached: recompute / L1 / L2 / L3", plan.ttft_reps, show) as advance:
        for r in range(plan.ttft_reps):
            s, _ = ttft(mem, f"cold-{r}", ids(L))
            out["recompute_s"].append(s)
            prefix = ids(P)
            ttft(mem, f"warm-{r}", prefix + ids(L - P))
            s, t = ttft(mem, f"l1-{r}", prefix + ids(L - P))
            out["l1_s"].append(s), tiers["l1"].append(t)
            drain_device_pool(mem)
            s, t = ttft(mem, f"l2-{r}", prefix + ids(L - P))
            out["l2_s"].append(s), tiers["l2"].append(t)

            prefix = ids(P)
            ttft(disk, f"warm-{r}", prefix + ids(L - P))
            disk.hicache.drain()
            drain_device_pool(disk)
            out.setdefault("files_dropped_from_page_cache", []).append(drop_page_cache(disk_dir))
            s, t = ttft(disk, f"l3-{r}", prefix + ids(L - P))
            out["l3_s"].append(s), tiers["l3"].append(t)
            drain_device_pool(disk)
            s, t = ttft(disk, f"l3pc-{r}", prefix + ids(L - P))
            out["l3_page_cache_s"].append(s), tiers["l3_page_cache"].append(t)
            advance()
    med = {k: float(np.median(v)) for k, v in out.items() if k.endswith("_s")}
    result = {"prompt_len": L, "cached_len": P, "reps": plan.ttft_reps, "device_pool_blocks": pool,
              **out, "median_s": med, "cached_by_tier": tiers,
              "hicache_stats": {"mem": mem.stats()["hicache"], "disk": disk.stats()["hicache"]}}
    for e in (mem, disk):
        e.close()
    return result


# -- 2. multi-turn chat, HiCache on vs off ---------------------------------------------------------
def chat_script(plan: Plan, vocab: int, seed: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each session's first prompt (shared system prompt + its own message) and its later user messages."""
    rng = np.random.default_rng(seed + 2)
    system = rng.integers(FIRST_ID, vocab, size=plan.system_len).tolist()
    firsts = [system + rng.integers(FIRST_ID, vocab, size=plan.first_user_len).tolist()
              for _ in range(plan.sessions)]
    users = [[rng.integers(FIRST_ID, vocab, size=plan.user_len).tolist() for _ in range(plan.turns - 1)]
             for _ in range(plan.sessions)]
    return firsts, users


def working_set_blocks(plan: Plan) -> tuple[int, int]:
    """(blocks of all sessions' final histories, the system prompt once; blocks of the longest request)."""
    last_prompt = plan.system_len + plan.first_user_len + (plan.turns - 1) * (plan.output_len + plan.user_len)
    longest = blocks_for(last_prompt + plan.output_len)
    per_session = blocks_for(last_prompt + plan.output_len - plan.system_len)
    return blocks_for(plan.system_len) + plan.sessions * per_session, longest


def run_chat(engine: LLMEngine, plan: Plan, firsts, users) -> dict:
    history = [list(f) for f in firsts]
    order = deque((s, t) for t in range(plan.turns) for s in range(plan.sessions))
    busy: dict[str, tuple[int, int, float]] = {}
    ttfts: list[float] = []
    tokens: dict[tuple[int, int], list[int]] = {}
    cached = {"device": 0, "host": 0, "disk": 0}
    prompt_tokens = 0
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    while order or busy:
        while order and len(busy) < plan.concurrency:
            s, t = order[0]
            if any(bs == s for bs, _, _ in busy.values()):
                break  # this session's previous turn is still running
            order.popleft()
            rid = f"s{s}-t{t}"
            busy[rid] = (s, t, time.perf_counter())
            engine.add_request(rid, history[s], greedy(plan.output_len))
            prompt_tokens += len(history[s])
        for out in engine.step():
            s, t, start = busy[out.request_id]
            if len(out.token_ids) == 1 and out.new_token_ids:
                ttfts.append(time.perf_counter() - start)
            if out.finished:
                del busy[out.request_id]
                tokens[(s, t)] = out.token_ids
                for tier, n in out.usage.cached_by_tier.items():
                    cached[tier] += n
                history[s] += out.token_ids + (users[s][t] if t < plan.turns - 1 else [])
    elapsed = time.perf_counter() - t0
    n_out = sum(len(v) for v in tokens.values())
    # CPU seconds of this process: less sensitive than wall time to other work on the machine.
    return {"seconds": elapsed, "cpu_seconds": time.process_time() - cpu0, "output_tokens": n_out,
            "tokens_per_s": n_out / elapsed, "prompt_tokens": prompt_tokens, "cached_tokens_by_tier": cached,
            "ttft_mean_s": float(np.mean(ttfts)), "ttft": C.latency_stats(ttfts),
            "preemptions": engine.stats()["preemptions"], "tokens": tokens}


def phase_multiturn(plan: Plan, model: str, seed: int, show: bool) -> dict:
    ws, longest = working_set_blocks(plan)
    pool = max(int(ws / plan.working_set_over_pool), plan.concurrency * longest + 4)
    budget = max(2048, longest * BLOCK_SIZE)
    runs = {}
    block_bytes = ModelConfig.from_dir(resolve_model(model)).kv_bytes_per_token(torch.float32) * BLOCK_SIZE
    for label, hc in (("off", HiCacheConfig()),
                      ("on", HiCacheConfig(enabled=True, host_bytes=2 * ws * block_bytes))):
        engine = make_engine(model, pool, budget, hc, max_num_seqs=plan.concurrency)
        firsts, users = chat_script(plan, engine.model_config.vocab_size, seed)
        engine.generate([firsts[0][:32]], greedy(2))  # warm-up, unrelated to the workload
        print(f"  hicache {label}: {plan.sessions} sessions x {plan.turns} turns ...", flush=True)
        runs[label] = run_chat(engine, plan, firsts, users)
        runs[label]["hicache_stats"] = engine.stats().get("hicache")
        engine.close()
        gc.collect()
    equal = runs["on"].pop("tokens") == runs["off"].pop("tokens")
    return {"working_set_blocks": ws, "device_pool_blocks": pool, "working_set_over_pool": ws / pool,
            "longest_request_blocks": longest, "max_num_batched_tokens": budget, "tokens_equal": equal, **runs}


def measure_ttft(plan: Plan, model: str, seed: int, disk_parent: Path | None, show: bool) -> dict:
    """phase_ttft with L3 in a fresh directory under `disk_parent`, removed after."""
    disk_dir = Path(tempfile.mkdtemp(prefix="hicache-bench-", dir=disk_parent))
    disk = disk_info(disk_dir)
    print(f"  L3 in {disk_dir} on {disk['device']} ({disk['fstype']}, rotational={disk.get('rotational')})")
    try:
        res = phase_ttft(plan, model, seed, disk_dir, show)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    print("  TTFT median: " + ", ".join(f"{k.removesuffix('_s')} {v * 1e3:.0f} ms" for k, v in res["median_s"].items()))
    return {**res, "disk": disk}


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "smoke run (< 1 minute); writes hicache_bench.quick.json", model=C.REAL_MODEL,
                    progress=True, seed=True, threads=True)
    ap.add_argument("--disk-dir", type=Path, default=None,
                    help="parent directory of the L3 cache directory (default: the system temp dir); "
                         "put it on the disk you mean to measure")
    args = ap.parse_args(argv)
    C.set_all_threads(args.threads)
    model_info = C.prepare_model(args.model)
    run = BenchRun(NAME, TARGETS, args)
    plan = run.plan(FULL, QUICK)
    print(f"{NAME}{' --quick' if args.quick else ''}: model={args.model} float32, {torch.get_num_threads()} "
          "torch threads")
    ttft_res = run.phase("ttft", measure_ttft, plan, args.model, args.seed, args.disk_dir, run.show)
    med = ttft_res["median_s"]
    chat = run.phase("multiturn", phase_multiturn, plan, args.model, args.seed, run.show)
    for label in ("off", "on"):
        r = chat[label]
        print(f"  {label}: {r['tokens_per_s']:.1f} tok/s, mean TTFT {r['ttft_mean_s'] * 1e3:.0f} ms, "
              f"cached {r['cached_tokens_by_tier']}")
    if not chat["tokens_equal"]:
        print("  WARNING: HiCache on and off produced different tokens")
    ratios = {
        "l2_ttft_vs_recompute": med["l2_s"] / med["recompute_s"],
        "l3_ttft_vs_recompute": med["l3_s"] / med["recompute_s"],
        "l1_ttft_vs_recompute": med["l1_s"] / med["recompute_s"],
        "multiturn_throughput_on_vs_off": chat["on"]["tokens_per_s"] / chat["off"]["tokens_per_s"],
        "multiturn_ttft_on_vs_off": chat["on"]["ttft_mean_s"] / chat["off"]["ttft_mean_s"],
    }
    return run.finish(ratios, model=args.model, model_info=model_info, dtype="float32", seed=args.seed,
                      torch_threads=torch.get_num_threads(), block_size=BLOCK_SIZE, disk=ttft_res.pop("disk"),
                      ttft=ttft_res, multiturn=chat)


if __name__ == "__main__":
    sys.exit(main())
