"""Front-door overhead: one 256-token streamed completion through gRPC and through HTTP, versus
the router's Python API called directly, all against the same cluster in one run.

The cluster (tiny preset, 1 prefill + 1 decode, disaggregated), the HTTP server and the gRPC
server run in this process as `brigade serve` runs them; the direct baseline streams through
the RouterActor from here. The gRPC (brigade-client) and HTTP (httpx, SSE on /v1/completions)
clients run in one long-lived child process, as real clients would, which runs one request
per command line on its stdin and answers its timing as a JSON line. The three paths take
turns request by request (the order rotating), so a drifting machine load hits them alike.

Ratios:
  grpc_e2e_vs_direct   mean end-to-end time of one streamed completion, gRPC / direct (<= 1.10)
  http_e2e_vs_direct   the same for HTTP SSE (<= 1.20)
  grpc_chunks_per_s    chunks a client receives per second over many concurrent gRPC streams (>= 5000)

The model stays the `tiny` preset, not SmolLM2-135M (the other benchmarks' default): what is
measured is the doors' own cost per token and chunk, which a real model's decode step
(SmolLM2: 135M parameters, over 100x tiny's) would hide, and grpc_chunks_per_s would then
count the model's steps, not the door. `--model NAME|PATH` runs another one all the same.

    python -m benchmarks.frontdoor_bench [--quick] [--model tiny|bench|NAME|PATH]   # --quick: < 1 min, .quick.json
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

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args

NAME = "frontdoor_bench"
TARGETS = {"grpc_e2e_vs_direct": "<= 1.10", "http_e2e_vs_direct": "<= 1.20", "grpc_chunks_per_s": ">= 5000"}
PROMPT = [5, 17, 300, 2, 99, 1000, 7, 42, 8, 13, 21, 34, 55, 89, 144, 233]
FULL = {"tokens": 256, "requests": 30, "warmup": 2, "streams": 64, "stream_tokens": 256}
QUICK = {"tokens": 256, "requests": 3, "warmup": 1, "streams": 16, "stream_tokens": 64}
MODES = ("direct", "grpc", "http")
WHY_TINY = "the doors' overhead is the measure: a real model's decode step would hide it"


def body(tokens: int) -> dict:
    return {"max_tokens": tokens, "temperature": 0.0, "ignore_eos": True}


# -- the client side (a child process) -------------------------------------------------------
class Clients:
    """One gRPC and one HTTP client, kept open across requests (connections stay warm)."""

    def __init__(self, grpc_target: str, http_base: str):
        import httpx
        from brigade_client import Client

        self.grpc, self.grpc_target = Client(grpc_target, timeout=300), grpc_target
        self.http = httpx.Client(base_url=http_base, timeout=300)

    def run(self, mode: str, tokens: int, streams: int) -> dict:
        start, count = time.perf_counter(), 0
        if mode == "grpc":
            for chunk in self.grpc.stream(PROMPT, **body(tokens)):
                count += len(chunk.token_ids)
        elif mode == "http":
            with self.http.stream("POST", "/v1/completions",
                                  json={"prompt": PROMPT, "stream": True, **body(tokens)}) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    count += line.startswith("data: {")
        else:
            return asyncio.run(self.concurrent(tokens, streams))
        return {"e2e_s": time.perf_counter() - start, "tokens_or_events": count}

    async def concurrent(self, tokens: int, streams: int) -> dict:
        from brigade_client import AsyncClient

        async with AsyncClient(self.grpc_target, timeout=300) as client:
            async def one() -> int:
                return sum([1 async for _ in client.stream(PROMPT, **body(tokens))])

            await one()  # connection and first-request costs stay out of the window
            start = time.perf_counter()
            chunks = await asyncio.gather(*(one() for _ in range(streams)))
            wall = time.perf_counter() - start
        return {"chunks": sum(chunks), "wall_s": wall, "chunks_per_s": sum(chunks) / wall}


def client_loop(grpc_target: str, http_base: str) -> None:
    clients = Clients(grpc_target, http_base)
    for line in sys.stdin:
        mode, tokens, streams = line.split()
        print(json.dumps(clients.run(mode, int(tokens), int(streams))), flush=True)


class ClientProcess:
    def __init__(self, grpc_target: str, http_base: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.frontdoor_bench", "--client-loop",
                                      grpc_target, http_base], cwd=C.ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def ask(self, mode: str, tokens: int, streams: int = 0) -> dict:
        self.proc.stdin.write(f"{mode} {tokens} {streams}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited ({self.proc.wait()}) during {mode}")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


# -- the server side (this process) ----------------------------------------------------------
def direct(router, tokens: int, concurrent: int = 0) -> dict:
    """The router's Python API from this process: one request's e2e time, or chunks per second
    over `concurrent` streams."""
    from engine.messages import GenerateRequest
    from engine.sampling import SamplingParams

    params = SamplingParams(**body(tokens))

    async def one(i: int) -> tuple[float, int]:
        start, chunks = time.perf_counter(), 0
        async for ref in router.generate.remote(GenerateRequest(f"direct-{time.monotonic_ns()}-{i}", PROMPT, params)):
            await ref
            chunks += 1
        return time.perf_counter() - start, chunks

    async def main() -> dict:
        if not concurrent:
            e2e, chunks = await one(0)
            return {"e2e_s": e2e, "tokens_or_events": chunks}
        await one(-1)
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i) for i in range(concurrent)))
        wall = time.perf_counter() - start
        return {"chunks": sum(c for _, c in results), "wall_s": wall,
                "chunks_per_s": sum(c for _, c in results) / wall}

    return asyncio.run(main())


def measure(plan: dict, model: str) -> dict:
    """A cluster with both doors in this process; each request mode's runs and the concurrent streams."""
    import ray

    from cluster.backend import ClusterBackend
    from cluster.config import ClusterConfig
    from cluster.launch import launch
    from router.config import FrontDoorConfig
    from router.grpc.server import GrpcServer
    from router.http.server import ApiServer
    from router.metrics import FrontDoorMetrics

    t0 = time.perf_counter()
    cfg = ClusterConfig(model=model, http_port=0, grpc_port=0, engine={"cache": {"num_blocks": 1024}})
    backend = ClusterBackend(cfg)
    http = ApiServer(cfg.host, 0)
    grpc_door = GrpcServer(cfg.host, 0, FrontDoorConfig(), FrontDoorMetrics())
    cluster = clients = None
    try:
        cluster = launch(cfg)
        backend.attach(cluster)
        http.backend = backend
        grpc_door.attach(backend)
        threading.Thread(target=http.serve_forever, name="http", daemon=True).start()
        clients = ClientProcess(grpc_door.address, http.url)
        print(f"  cluster up in {time.perf_counter() - t0:.0f} s; gRPC {grpc_door.address}, HTTP {http.url}")

        def one(mode: str) -> dict:
            return direct(cluster.router, plan["tokens"]) if mode == "direct" else clients.ask(mode, plan["tokens"])

        for mode in MODES * plan["warmup"]:
            one(mode)
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        for i in range(plan["requests"]):
            for mode in MODES[i % 3:] + MODES[:i % 3]:  # rotate who goes first
                runs[mode].append(one(mode))
        assert {r["tokens_or_events"] for r in runs["grpc"]} == {plan["tokens"]}, "gRPC streams lost tokens"
        streamed = clients.ask("grpc_concurrent", plan["stream_tokens"], plan["streams"])
        baseline = direct(cluster.router, plan["stream_tokens"], concurrent=plan["streams"])
    finally:
        if clients is not None:
            clients.close()
        grpc_door.close()
        http.server_close()
        if cluster is not None:
            cluster.shutdown()
        ray.shutdown()
    return {"runs": runs, "grpc_concurrent": streamed, "direct_concurrent": baseline}


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "a smoke run; writes frontdoor_bench.quick.json", model="tiny", why=WHY_TINY)
    ap.add_argument("--client-loop", nargs=2, metavar=("GRPC", "HTTP"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.client_loop:
        client_loop(*args.client_loop)
        return 0
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # not one INFO line per fork while gRPC threads run
    import torch

    torch.set_num_threads(1)
    model_info = C.prepare_model(args.model)
    run = BenchRun(NAME, TARGETS, args)
    plan = run.plan(FULL, QUICK)
    print(f"{run.name}: model={args.model}, {plan}; load average {run.machine['load_average_start']}")
    m = run.phase("requests through each door", measure, plan, args.model)
    runs, streamed, baseline = m["runs"], m["grpc_concurrent"], m["direct_concurrent"]
    e2e = {mode: sum(r["e2e_s"] for r in runs[mode]) / len(runs[mode]) for mode in MODES}
    print("  mean e2e over " + ", ".join(f"{mode} {e2e[mode] * 1e3:.0f} ms" for mode in MODES))
    print(f"  {plan['streams']} concurrent streams: gRPC {streamed['chunks_per_s']:.0f} chunks/s, "
          f"direct {baseline['chunks_per_s']:.0f} chunks/s")
    ratios = {"grpc_e2e_vs_direct": e2e["grpc"] / e2e["direct"], "http_e2e_vs_direct": e2e["http"] / e2e["direct"],
              "grpc_chunks_per_s": streamed["chunks_per_s"]}
    return run.finish(ratios, model=args.model, model_info=model_info, why_tiny=WHY_TINY, prompt_tokens=len(PROMPT),
                      mean_e2e_s=e2e,
                      per_token_overhead_s={mode: (e2e[mode] - e2e["direct"]) / plan["tokens"]
                                            for mode in ("grpc", "http")},
                      e2e_s={mode: C.summarize(r["e2e_s"] for r in runs[mode]) for mode in MODES}, **m,
                      grpc_vs_direct_chunks_per_s=streamed["chunks_per_s"] / baseline["chunks_per_s"])


if __name__ == "__main__":
    sys.exit(main())
