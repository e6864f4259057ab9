"""Chaos: clients sending huge text prompts through both doors of a real `brigade serve` (`tiny`,
1 prefill + 1 decode) while another process probes HTTP /health and gRPC health.

Each client loops, alternating a 4,000,000-character prompt (under the 4 MiB message limit;
refused naming `prompt` before it is tokenized: longer than the context could hold) and one of
exactly the bound's length (tokenized, with the GIL released and a few at once, then refused as
over the context). Every answer is such a refusal, or a 429 / RESOURCE_EXHAUSTED when the
tokenizer's waiting room is full; every probe answers. Figure: the probes' p99 latency, both
doors together (target < 50 ms), beside the same probes' p99 with no load (what the machine and
the HTTP door's health cache refresh, a router call every 0.5 s, cost without it). A 4 MB
prompt once froze the whole serve process for seconds.

CI runs 2 clients per door for 2 s; BRIGADE_CHAOS_FULL=1 runs 8 per door for 10 s.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from brigade_client.errors import FIELD_KEY
from brigade_client.v1 import brigade_pb2 as pb
from serve_process import Served, brigade_serve
from support import FULL

from engine.engine_setup import context_length
from engine.model_config import ModelConfig
from engine.presets import resolve_model
from engine.tokenizer import Tokenizer

CLIENTS = 8 if FULL else 2  # per door
LOAD_S = 10.0 if FULL else 2.0
IDLE_S = 5.0 if FULL else 1.0
HUGE = 4_000_000  # characters
WORDS = "the quick brown fox jumps over a lazy dog while naive cafes hum 1234 ".split()

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# The prober runs in a process of its own, so the load's client threads here cannot delay its
# readings: a probe every 20 ms, each door in turn; prints {"http": [s...], "grpc": [s...]}.
PROBER = """
import json, sys, time
import httpx
from brigade_client import Client
base, target, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
out = {"http": [], "grpc": [], "failed": []}
with httpx.Client(base_url=base, timeout=30) as h, Client(target, timeout=30) as g:
    h.get("/health"); g.health()  # connected before the load starts
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t = time.perf_counter(); r = h.get("/health"); out["http"].append(time.perf_counter() - t)
        if r.status_code != 200: out["failed"].append(f"http {r.status_code}")
        t = time.perf_counter(); s = g.health(); out["grpc"].append(time.perf_counter() - t)
        if s != "SERVING": out["failed"].append(f"grpc {s}")
        time.sleep(0.02)
print(json.dumps(out), flush=True)
"""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("huge")
    with brigade_serve(["--http-port", "0", "--grpc-port", "0", "--num-blocks", "128"], tmp / "serve.log") as s:
        yield s


def at_the_bound() -> str:
    """A text of exactly the serve's bound (max_model_len x the longest vocabulary entry)."""
    path = resolve_model("tiny")
    tok = Tokenizer.from_dir(path)
    tok.limit(context_length(None, ModelConfig.from_dir(path)))
    text = " ".join(f"{WORDS[i % len(WORDS)]}{i % 89}" for i in range(tok.max_text_chars // 4))
    return text.ljust(tok.max_text_chars, "z")[:tok.max_text_chars]


def probe(served: Served, seconds: float) -> dict[str, list]:
    done = subprocess.run([sys.executable, "-c", PROBER, served.http_base, served.grpc_target, str(seconds)],
                          capture_output=True, text=True, timeout=120 + seconds, check=True)
    return json.loads(done.stdout.splitlines()[-1])


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def test_health_answers_while_clients_send_huge_prompts_through_both_doors(served: Served, chaos_figure) -> None:
    bound = at_the_bound()
    prompts = ["x" * HUGE, bound]
    http_bodies = [json.dumps({"prompt": p, "max_tokens": 1}).encode() for p in prompts]
    grpc_bodies = [pb.GenerateRequest(text=p, sampling=pb.SamplingParams(max_tokens=1)).SerializeToString()
                   for p in prompts]
    stop = threading.Event()

    def http_client(i: int) -> list[str]:
        seen = []
        with httpx.Client(base_url=served.http_base, timeout=120) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", content=http_bodies[len(seen) % 2],
                           headers={"Content-Type": "application/json"})
                param = r.json().get("error", {}).get("param")
                seen.append(f"http {r.status_code} {param}" if r.status_code != 429 else "http 429")
        return seen

    def grpc_client(i: int) -> list[str]:
        seen = []
        options = [("grpc.max_send_message_length", 8 << 20)]
        with grpc.insecure_channel(served.grpc_target, options=options) as ch:
            call = ch.unary_unary("/brigade.v1.Brigade/GenerateUnary")
            while not stop.is_set():
                try:
                    call(grpc_bodies[len(seen) % 2], timeout=120)
                    seen.append("grpc OK")
                except grpc.RpcError as exc:
                    field = dict(exc.trailing_metadata() or ()).get(FIELD_KEY)
                    seen.append(f"grpc {exc.code().name} {field}" if field else f"grpc {exc.code().name}")
        return seen

    idle = probe(served, IDLE_S)  # the same probes with no load: what the machine itself adds
    prober = subprocess.Popen([sys.executable, "-c", PROBER, served.http_base, served.grpc_target, str(LOAD_S)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert prober.stdout.readline().strip() == "ready"
        start = time.monotonic()
        with ThreadPoolExecutor(2 * CLIENTS) as pool:
            loads = [pool.submit(http_client, i) for i in range(CLIENTS)]
            loads += [pool.submit(grpc_client, i) for i in range(CLIENTS)]
            probes = json.loads(prober.stdout.readline())
            stop.set()
            answers = Counter(a for f in loads for a in f.result(timeout=300))
        seconds = time.monotonic() - start
    finally:
        if prober.poll() is None:
            prober.kill()
        prober.wait(30)

    every = probes["http"] + probes["grpc"]
    p99 = pct(every, 0.99)
    idle_every = idle["http"] + idle["grpc"]
    figure = {"clients_per_door": CLIENTS, "seconds": round(seconds, 1), "prompt_chars": [HUGE, len(bound)],
              "answers": dict(answers), "probes": len(every),
              "idle_health_p99_ms": round(1000 * pct(idle_every, 0.99), 1),
              "http_health_p99_ms": round(1000 * pct(probes["http"], 0.99), 1),
              "grpc_health_p99_ms": round(1000 * pct(probes["grpc"], 0.99), 1),
              "health_p50_ms": round(1000 * pct(every, 0.5), 1),
              "health_max_ms": round(1000 * max(every), 1)}
    print(f"\nhuge prompts: health p99 {1000 * p99:.1f} ms; {json.dumps(figure)}")
    chaos_figure("huge_prompts", ratios={"health_p99_ms": round(1000 * p99, 1)},
                 targets={"health_p99_ms": "< 50"}, **figure)

    assert not probes["failed"], probes["failed"][:5]
    allowed = {"http 400 prompt", "http 429", "grpc INVALID_ARGUMENT prompt", "grpc RESOURCE_EXHAUSTED"}
    assert set(answers) <= allowed, answers
    assert answers["http 400 prompt"] and answers["grpc INVALID_ARGUMENT prompt"], answers
