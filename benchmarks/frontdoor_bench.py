"""Front-door overhead: one 256-token streamed completion through gRPC and through HTTP, versus
the router's Python API called directly, all against the same cluster in one run.

The cluster (tiny preset, 1 prefill + 1 decode, disaggregated), the HTTP server and the gRPC
server run in this process as `brigade serve` runs them; the direct baseline streams through
the RouterActor from here. The gRPC (brigade-client) and HTTP (httpx, SSE on /v1/completions)
clients run in a child process, as real clients would, and report their timings as JSON on
stdout. Modes take turns in blocks so a drifting machine load hits them alike.

Ratios:
  grpc_e2e_vs_direct   mean end-to-end time of one streamed completion, gRPC / direct (<= 1.10)
  http_e2e_vs_direct   the same for HTTP SSE (<= 1.20)
  grpc_chunks_per_s    chunks a client receives per second over many concurrent gRPC streams (>= 5000)

    python benchmarks/frontdoor_bench.py [--quick]   # --quick: a smoke run (< 1 min), .quick.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common as C  # noqa: E402

NAME = "frontdoor_bench"
TARGETS = {"grpc_e2e_vs_direct": "<= 1.10", "http_e2e_vs_direct": "<= 1.20", "grpc_chunks_per_s": ">= 5000"}
PROMPT = [5, 17, 300, 2, 99, 1000, 7, 42, 8, 13, 21, 34, 55, 89, 144, 233]
FULL = {"tokens": 256, "requests": 10, "rounds": 3, "streams": 64, "stream_tokens": 256}
QUICK = {"tokens": 256, "requests": 2, "rounds": 1, "streams": 16, "stream_tokens": 64}


# -- the client side (a child process) -------------------------------------------------------
def client_main(mode: str, target: str, n: int, tokens: int, streams: int) -> dict:
    """Timings for `n` sequential streamed completions (mode grpc|http), or chunks per second
    over `streams` concurrent gRPC streams (mode grpc_concurrent)."""
    body = {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}
    if mode == "grpc":
        from brigade_client import Client

        out = []
        with Client(target, timeout=300) as client:
            for _ in range(n):
                start, count = time.perf_counter(), 0
                for chunk in client.stream(PROMPT, **body):
                    count += len(chunk.token_ids)
                out.append({"e2e_s": time.perf_counter() - start, "tokens": count})
        return {"requests": out}
    if mode == "http":
        import httpx

        out = []
        with httpx.Client(base_url=target, timeout=300) as client:
            for _ in range(n):
                start, events = time.perf_counter(), 0
                with client.stream("POST", "/v1/completions", json={"prompt": PROMPT, "stream": True, **body}) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        events += line.startswith("data: {")
                out.append({"e2e_s": time.perf_counter() - start, "events": events})
        return {"requests": out}

    async def concurrent() -> dict:
        from brigade_client import AsyncClient

        async with AsyncClient(target, timeout=300) as client:
            async def one() -> int:
                return sum([1 async for _ in client.stream(PROMPT, **body)])

            await one()  # connection and first-request costs stay out of the window
            start = time.perf_counter()
            chunks = await asyncio.gather(*(one() for _ in range(streams)))
            wall = time.perf_counter() - start
        return {"chunks": sum(chunks), "wall_s": wall, "chunks_per_s": sum(chunks) / wall}

    return asyncio.run(concurrent())


def run_client(mode: str, target: str, n: int, tokens: int, streams: int = 0) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--client", mode, target, str(n), str(tokens), str(streams)],
                          capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(C.ROOT)})
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} client failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


# -- the server side (this process) ----------------------------------------------------------
def direct(router, n: int, tokens: int, concurrent: int = 0) -> dict:
    """The router's Python API from this process: sequential e2e times, or chunks per second."""
    from engine.sampling import SamplingParams
    from router.types import GenerateRequest

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    counter = iter(range(10**9))

    async def one() -> tuple[float, int]:
        start, chunks = time.perf_counter(), 0
        async for ref in router.generate.remote(GenerateRequest(f"direct-{next(counter)}", PROMPT, params)):
            await ref
            chunks += 1
        return time.perf_counter() - start, chunks

    async def main() -> dict:
        if not concurrent:
            return {"requests": [{"e2e_s": (await one())[0]} for _ in range(n)]}
        await one()
        start = time.perf_counter()
        results = await asyncio.gather(*(one() for _ in range(concurrent)))
        wall = time.perf_counter() - start
        return {"chunks": sum(c for _, c in results), "wall_s": wall, "chunks_per_s": sum(c for _, c in results) / wall}

    return asyncio.run(main())


def mean_e2e(blocks: list[dict]) -> float:
    times = [r["e2e_s"] for b in blocks for r in b["requests"]]
    return sum(times) / len(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smoke run; writes frontdoor_bench.quick.json")
    ap.add_argument("--client", nargs=5, metavar=("MODE", "TARGET", "N", "TOKENS", "STREAMS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client:
        mode, target, n, tokens, streams = args.client
        print(json.dumps(client_main(mode, target, int(n), int(tokens), int(streams))))
        return 0

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not one INFO line per fork while gRPC threads run
    import ray
    import torch

    from cluster.backend import ClusterBackend
    from cluster.config import ClusterConfig
    from cluster.launch import launch
    from router.config import FrontDoorConfig
    from router.grpc_server import GrpcServer
    from router.http_api import ApiServer
    from router.metrics import FrontDoorMetrics

    plan = QUICK if args.quick else FULL
    name = NAME + (".quick" if args.quick else "")
    torch.set_num_threads(1)
    machine = C.machine_info()
    print(f"{NAME}{' --quick' if args.quick else ''}: tiny preset, {plan}; "
          f"load average {machine['load_average_start']}")
    t0 = time.perf_counter()
    cfg = ClusterConfig(http_port=0, grpc_port=0, engine={"num_blocks": 1024})
    backend = ClusterBackend(cfg)
    http = ApiServer(cfg.host, 0)
    grpc_door = GrpcServer(cfg.host, 0, FrontDoorConfig(), FrontDoorMetrics())
    cluster = None
    try:
        cluster = launch(cfg)
        backend.attach(cluster)
        http.backend = backend
        grpc_door.attach(backend)
        threading.Thread(target=http.serve_forever, name="http", daemon=True).start()
        print(f"- cluster up in {time.perf_counter() - t0:.0f} s; gRPC {grpc_door.address}, HTTP {http.url}")

        direct(cluster.router, 1, plan["tokens"])  # warm-up: first-request costs on every path
        run_client("grpc", grpc_door.address, 1, plan["tokens"])
        run_client("http", http.url, 1, plan["tokens"])
        blocks: dict[str, list[dict]] = {"direct": [], "grpc": [], "http": []}
        for r in range(plan["rounds"]):
            blocks["direct"].append(direct(cluster.router, plan["requests"], plan["tokens"]))
            blocks["grpc"].append(run_client("grpc", grpc_door.address, plan["requests"], plan["tokens"]))
            blocks["http"].append(run_client("http", http.url, plan["requests"], plan["tokens"]))
            print(f"- round {r + 1}: " + ", ".join(f"{m} {mean_e2e(b[-1:]) * 1e3:.0f} ms" for m, b in blocks.items()))
        streamed = run_client("grpc_concurrent", grpc_door.address, 0, plan["stream_tokens"], plan["streams"])
        baseline = direct(cluster.router, 0, plan["stream_tokens"], concurrent=plan["streams"])
        print(f"- {plan['streams']} concurrent streams: gRPC {streamed['chunks_per_s']:.0f} chunks/s, "
              f"direct {baseline['chunks_per_s']:.0f} chunks/s")
        token_counts = {r["tokens"] for b in blocks["grpc"] for r in b["requests"]}
        assert token_counts == {plan["tokens"]}, f"gRPC streams returned {token_counts} tokens"
    finally:
        grpc_door.close()
        http.server_close()
        if cluster is not None:
            cluster.shutdown()
        ray.shutdown()

    e2e = {mode: mean_e2e(b) for mode, b in blocks.items()}
    ratios = {"grpc_e2e_vs_direct": e2e["grpc"] / e2e["direct"], "http_e2e_vs_direct": e2e["http"] / e2e["direct"],
              "grpc_chunks_per_s": streamed["chunks_per_s"]}
    machine["load_average_end"] = C.load_average()
    raw = {"plan": plan, "prompt_tokens": len(PROMPT), "mean_e2e_s": e2e,
           "per_token_overhead_s": {m: (e2e[m] - e2e["direct"]) / plan["tokens"] for m in ("grpc", "http")},
           "blocks": blocks, "grpc_concurrent": streamed, "direct_concurrent": baseline,
           "total_seconds": time.perf_counter() - t0}
    print(f"wrote {C.write_result(name, machine, ratios, TARGETS, raw)}")
    C.print_ratios(ratios, TARGETS, title=f"{NAME} ({raw['total_seconds']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
