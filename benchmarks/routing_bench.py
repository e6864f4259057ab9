"""Routing policies on the real Mooncake conversation trace: prefix-cache hit ratio and TTFT.

The trace (../shared/data/mooncake_conversation_trace.jsonl, one hour of production traffic)
gives per request an arrival time (ms), input and output lengths and the hash ids of its
512-token prefix blocks. Scaled to this machine:

- sessions: the first `Plan.sessions` conversations of the trace with all their turns (a turn
  belongs to the conversation named by its second hash id; the first, id 0, is shared by
  every request), so follow-up turns really arrive;
- blocks: each hash id becomes one deterministic 16-token block (token ids from a PRNG seeded
  by the id): lengths shrink by 512/16 = 32, and a prompt is capped at MAX_BLOCKS blocks;
- time: the selected requests' arrival times are compressed into `Plan.duration_s` seconds
  (full: 160 sessions, 332 requests, about 3,400 s of trace in 40 s, i.e. ~85x);
- output: max_tokens=1 (TTFT is what routing changes; decode would only add noise).

A real cluster (Ray, redis-server, 4 prefill workers + 1 decode worker, `tiny` preset) whose
per-worker device pool (`Plan.num_blocks`: 768 blocks full, 256 quick) holds a fraction of
the replay's working set (about 5,000 distinct blocks full, 1,250 quick), so which worker a
follow-up turn lands on decides whether its previous turns are still cached.
After an unmeasured warm-up, the three policies run one after another on the same workers:
each replay carries its own cache salt, so no policy finds another's blocks (they are only
LRU filler). Reported per
policy: hit ratio (cached prompt tokens / prompt tokens), mean and p90 TTFT as the client
sees it (a request refused with NoWorker, the one decode pool momentarily full, is retried
after 50 ms, and its TTFT counts from the first try).
The ideal hit ratio is that of one infinite cache seeing the same requests in order.
First, the longest-prefix query alone: 100,000 blocks indexed for 4 workers, queries of
real trace prompts over loopback, p99 latency (and Redis's own time per query from
INFO commandstats, which the OS scheduler of a busy machine does not inflate).

The model stays the `tiny` preset, not SmolLM2-135M (the other benchmarks' default): the replay
sends hundreds of prompts of up to 1,536 tokens to 4 prefill workers on 2 cores within
`Plan.duration_s`; SmolLM2's prefill (135M parameters, over 100x tiny's) would turn every
TTFT into queueing that no routing policy removes. `--model NAME|PATH` runs another one all the same.

--quick: fewer sessions and a shorter replay; writes routing_bench.quick.json.
"""
from __future__ import annotations

import asyncio
import gc
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args

NAME = "routing_bench"
TRACE = Path("/work/shared/data/mooncake_conversation_trace.jsonl")
TRACE_BLOCK, BLOCK = 512, 16
MAX_BLOCKS = 96  # 1536 tokens: well inside the tiny preset's context
VOCAB = 4096
POLICIES = ("kv_aware", "least_loaded", "round_robin")
WHY_TINY = "the replay's prefills at the trace's pace: a real model would make TTFT queueing, not routing"
TARGETS = {"hit_ratio_vs_ideal": ">= 0.85", "hit_ratio_vs_round_robin": ">= 2.0",
           "ttft_p90_vs_round_robin": "<= 0.6", "index_query_p99_ms": "< 2"}


@dataclass(frozen=True)
class Plan:
    sessions: int
    duration_s: float
    num_blocks: int  # per worker
    index_blocks: int
    index_queries: int


FULL = Plan(sessions=160, duration_s=40.0, num_blocks=768, index_blocks=100_000, index_queries=2000)
QUICK = Plan(sessions=40, duration_s=6.0, num_blocks=256, index_blocks=100_000, index_queries=500)


@dataclass(frozen=True)
class Request:
    at_s: float
    hash_ids: tuple[int, ...]
    prompt: list[int]


def block_tokens(hash_id: int) -> list[int]:
    rng = random.Random(hash_id)
    return [rng.randrange(3, VOCAB) for _ in range(BLOCK)]


def load_requests(path: Path, sessions: int, duration_s: float) -> tuple[list[Request], float]:
    """The chosen sessions' requests in arrival order, and the time compression factor."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    first_seen: dict[object, int] = {}
    for i, r in enumerate(rows):
        first_seen.setdefault(r["hash_ids"][1] if len(r["hash_ids"]) > 1 else ("solo", i), i)
    chosen = set(sorted(first_seen, key=first_seen.get)[:sessions])
    picked = [r for i, r in enumerate(rows)
              if (r["hash_ids"][1] if len(r["hash_ids"]) > 1 else ("solo", i)) in chosen]
    t0, t1 = picked[0]["timestamp"], picked[-1]["timestamp"]
    scale = duration_s / max(1.0, t1 - t0)
    out = []
    for r in picked:
        ids = tuple(r["hash_ids"][:MAX_BLOCKS])
        n_tokens = min(max(2, r["input_length"] * BLOCK // TRACE_BLOCK), len(ids) * BLOCK)
        prompt = [t for h in ids for t in block_tokens(h)][:n_tokens]
        out.append(Request((r["timestamp"] - t0) * scale, ids[: -(-n_tokens // BLOCK)], prompt))
    return out, 1 / (1000 * scale)  # timestamps are in ms


def ideal_hit_ratio(requests: list[Request]) -> float:
    """One infinite cache: a request hits the longest seen prefix of its blocks (its last token
    is always computed, as in the engine)."""
    seen: set[tuple[int, ...]] = set()
    hit = total = 0
    for r in requests:
        usable = (len(r.prompt) - 1) // BLOCK
        k = 0
        while k < usable and r.hash_ids[: k + 1] in seen:
            k += 1
        seen.update(r.hash_ids[: i + 1] for i in range(len(r.prompt) // BLOCK))
        hit, total = hit + k * BLOCK, total + len(r.prompt)
    return hit / total


async def replay(router, requests: list[Request], salt: str) -> list[dict]:
    from engine import SamplingParams
    from engine.messages import GenerateRequest

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    start = time.monotonic()

    async def one(i: int, r: Request) -> dict:
        await asyncio.sleep(max(0.0, start + r.at_s - time.monotonic()))
        sent = time.monotonic()
        for attempt in range(50):  # NoWorker (the decode pool is momentarily full): retry like a client would
            try:
                last = None
                async for ref in router.generate.remote(GenerateRequest(f"{salt}-{i}", r.prompt, params,
                                                                        cache_salt=salt)):
                    last = await ref
                # max_tokens=1: the one chunk is the first token. Timed from the first try, retries included.
                return {"prompt": len(r.prompt), "cached": last.usage.cached_tokens, "ttft_s": time.monotonic() - sent,
                        "worker": last.prefill_worker, "retries": attempt}
            except Exception as exc:
                if "NoWorker" not in repr(exc):
                    raise
                await asyncio.sleep(0.05)
        raise RuntimeError(f"request {i} found no worker 50 times")

    return await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))


def summarize_run(rows: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in rows]
    workers: dict[str, int] = {}
    for r in rows:
        workers[r["worker"]] = workers.get(r["worker"], 0) + 1
    return {"requests": len(rows), "hit_ratio": sum(r["cached"] for r in rows) / sum(r["prompt"] for r in rows),
            "ttft_s": C.latency_stats(ttfts), "per_worker_requests": workers,
            "retries": sum(r["retries"] for r in rows)}


def cluster_phase(plan: Plan, requests: list[Request], model: str) -> dict:
    import ray

    from cluster.config import ClusterConfig
    from cluster.launch import launch, start_ray
    from cluster.redis_server import EmbeddedRedis

    cfg = ClusterConfig(model=model, prefill=4, decode=1, num_cpus=2,
                        engine={"cache": {"num_blocks": plan.num_blocks}, "scheduler": {"max_num_seqs": 64}},
                        router={"health_interval_s": 0.5})
    out: dict = {"config": cfg.model_dump(mode="json")}
    with EmbeddedRedis() as redis_server:
        start_ray(cfg)
        t = time.perf_counter()
        cluster = launch(cfg, redis_server.url)
        out["startup_s"] = time.perf_counter() - t
        try:
            # Warm-up (first calls on every path, buffers, threads), not measured: a short replay
            # of other prompts under round_robin, so every worker serves some.
            ray.get(cluster.router.set_policy.remote("round_robin"))
            t = time.perf_counter()
            asyncio.run(replay(cluster.router, [Request(0.05 * i, r.hash_ids, r.prompt) for i, r in
                                                enumerate(requests[:16])], salt="warmup"))
            out["warmup_s"] = time.perf_counter() - t
            for policy in POLICIES:
                ray.get(cluster.router.set_policy.remote(policy))
                t = time.perf_counter()
                rows = asyncio.run(replay(cluster.router, requests, salt=policy))
                out[policy] = summarize_run(rows) | {"wall_s": time.perf_counter() - t}
                print(f"  {policy}: hit ratio {out[policy]['hit_ratio']:.3f}, TTFT mean "
                      f"{out[policy]['ttft_s']['mean'] * 1e3:.1f} ms p90 {out[policy]['ttft_s']['p90'] * 1e3:.1f} ms, "
                      f"workers {out[policy]['per_worker_requests']}", flush=True)
            out["router_status"] = ray.get(cluster.router.status.remote())
        finally:
            cluster.shutdown()
            ray.shutdown()
    return out


def index_phase(plan: Plan, requests: list[Request]) -> dict:
    """p50/p99 of one longest-prefix query with plan.index_blocks blocks indexed (4 workers)."""
    from cluster.redis_server import EmbeddedRedis
    from engine.block_hash import chain_hashes
    from router.index.keys import encode
    from router.index.query import PrefixIndex
    from router.index.registry import connect

    rng = random.Random(0)
    with EmbeddedRedis() as srv:
        client = connect(srv.url)
        index = PrefixIndex(client, "bench", "tiny")
        workers = {f"prefill-{i}": 1 for i in range(4)}
        prompts = [chain_hashes(r.prompt, BLOCK, "tiny") for r in requests]
        indexed: set[bytes] = set()
        with client.pipeline(transaction=False) as p:
            for hashes in prompts:  # the trace's own chains, each held by 1-2 workers
                for w in rng.sample(sorted(workers), rng.randint(1, 2)):
                    for h in hashes:
                        p.hset(index.keys.block(h), w, encode(1, 1))
                indexed.update(hashes)
            while len(indexed) < plan.index_blocks:  # filler chains up to the target size
                for h in chain_hashes([rng.randrange(VOCAB) for _ in range(BLOCK * 64)], BLOCK, "tiny"):
                    p.hset(index.keys.block(h), rng.choice(sorted(workers)), encode(1, 1 << rng.randrange(3)))
                    indexed.add(h)
            p.execute()
        keys = client.dbsize()
        del indexed
        # The harness's own 100k-object set must not cost the query gen-2 GC passes (a router holds none).
        gc.collect()
        gc.freeze()
        for hashes in prompts[:50]:  # warm-up (script load, connections)
            index.query(hashes, workers)
        lat = []
        for i in range(plan.index_queries):
            hashes = prompts[i % len(prompts)]
            t = time.perf_counter()
            index.query(hashes, workers)
            lat.append((time.perf_counter() - t) * 1e3)
        gc.unfreeze()
        # Redis's own time per query (the script), apart from the client's and the OS scheduler's.
        server_us = client.info("commandstats").get("cmdstat_evalsha", {}).get("usec_per_call")
        client.close()
    return {"indexed_blocks": keys, "query_ms": C.latency_stats(lat), "server_usec_per_query": server_us,
            "mean_blocks_per_query": sum(len(p) for p in prompts) / len(prompts)}


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "a smoke run; writes routing_bench.quick.json", model="tiny", why=WHY_TINY)
    ap.add_argument("--trace", type=Path, default=TRACE)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    model_info = C.prepare_model(args.model)
    assert model_info["vocab_size"] >= VOCAB, f"--model {args.model}: the replay's token ids run up to {VOCAB}"
    run = BenchRun(NAME, TARGETS, args, cluster_cores=2)
    plan = run.plan(FULL, QUICK)
    requests, compression = load_requests(args.trace, plan.sessions, plan.duration_s)
    ideal = ideal_hit_ratio(requests)
    print(f"{run.name}: {len(requests)} requests from {plan.sessions} sessions in {plan.duration_s:g} s "
          f"(time compressed {compression:.0f}x), "
          f"{sum(len(r.prompt) for r in requests)} prompt tokens, ideal hit ratio {ideal:.3f}", flush=True)
    idx = run.phase("index query latency", index_phase, plan, requests)
    print(f"  {idx['indexed_blocks']} blocks indexed: p50 {idx['query_ms']['p50']:.3f} ms, "
          f"p99 {idx['query_ms']['p99']:.3f} ms", flush=True)
    runs = run.phase("replay on the cluster", cluster_phase, plan, requests, args.model)
    kv, rr = runs["kv_aware"], runs["round_robin"]
    ratios = {
        "hit_ratio_vs_ideal": kv["hit_ratio"] / ideal if ideal else None,
        "hit_ratio_vs_round_robin": kv["hit_ratio"] / rr["hit_ratio"] if rr["hit_ratio"] else None,
        "ttft_p90_vs_round_robin": kv["ttft_s"]["p90"] / rr["ttft_s"]["p90"],
        "index_query_p99_ms": idx["query_ms"]["p99"],
    }
    return run.finish(ratios, model=args.model, model_info=model_info, why_tiny=WHY_TINY, scaling={
        "trace_block_tokens": TRACE_BLOCK, "block_tokens": BLOCK, "length_factor": TRACE_BLOCK / BLOCK,
        "max_blocks": MAX_BLOCKS, "time_compression": compression, "max_tokens": 1},
        requests=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests), ideal_hit_ratio=ideal,
        index=idx, cluster=runs)


if __name__ == "__main__":
    sys.exit(main())
