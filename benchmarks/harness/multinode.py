"""The multi-node scenarios the node-loss chaos test asserts on and benchmarks/multinode_bench.py
measures: each builds its own cluster (benchmarks/harness/ray_nodes.py) and `brigade serve` processes, runs,
tears everything down and returns its figures.

node_loss: a head (fronts only), node B (127.0.19.2: the prefill worker and one decode worker)
and node C (127.0.19.3: the other decode worker); a spare node D (127.0.19.4) joins once serving.
Under `streams` live greedy requests node C is lost (every process of it SIGKILLed): each request
must end token-identical or refused as retriable (503), none may hang; the router ejects C's
worker, the supervisor replaces it on D, the only node with room. Then C comes back and D is
lost: the next replacement lands on C.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

from benchmarks.harness.ray_nodes import HEAD_IP, RayNodes
from benchmarks.harness.served import served_fleet

NODE_B, NODE_C, NODE_D = "127.0.19.2", "127.0.19.3", "127.0.19.4"
PLACEMENT = {"placement": {"prefill": {"prefill": 1}, "decode": {"decode": 1}}, "transfer": {"host": "node"},
             "supervisor": {"grace_s": 1.0}}
HUNG_S = 240.0  # a request not ended by then counts as hung


def _serve(flags: list[str], log: Path, timeout_s: float, env: dict[str, str]):
    """A served fleet in float32, the dtype of reference_tokens' engine (`auto` picks bfloat16 on
    CPUs with bfloat16 instructions), of serve's default model, built once up front."""
    from engine.presets import materialize

    materialize("tiny")
    return served_fleet([*flags, "--dtype", "float32"], log, timeout_s, env)


def complete(base: str, prompt: list[int], max_tokens: int, timeout_s: float = HUNG_S) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(f"{base}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def health(base: str) -> dict:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:  # 503 while a role has no live worker: its body says so
        return json.loads(exc.read())


def reference_tokens(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=512)))
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.token_ids for o in engine.generate(prompts, params)]


def _outcome(base: str, prompt: list[int], max_tokens: int, expected: list[int]) -> str:
    try:
        got = complete(base, prompt, max_tokens)["choices"][0]["token_ids"]
    except urllib.error.HTTPError as exc:
        return "retriable" if exc.code == 503 else f"failed {exc.code}"
    except (TimeoutError, urllib.error.URLError, OSError) as exc:
        return f"hung ({type(exc).__name__})"
    return "identical" if got == expected else "DIFFERENT"


def _wait(predicate, timeout_s: float, interval_s: float = 0.1) -> float | None:
    """When (monotonic) predicate() was first seen true, or None if not within timeout_s."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            if predicate():
                return time.monotonic()
        except Exception:  # noqa: BLE001 - a slow answer under load: poll again
            pass
        time.sleep(interval_s)
    return None


def node_loss(tmp: Path, streams: int = 8, max_tokens: int = 160, rejoin: bool = True) -> dict:
    """Figures: outcomes of the live requests, seconds (from the kill) to ejection, to the
    replacement serving, to the first new request answered; where the replacements landed."""
    import random

    rng = random.Random(7)
    prompts = [[rng.randrange(3, 4096) for _ in range(24)] for _ in range(streams)]
    expected = reference_tokens(prompts, max_tokens)
    nodes = RayNodes(tmp)
    with nodes.client(), ExitStack() as stack:  # this process's Ray client uses the token too
        stack.callback(nodes.stop)
        nodes.start_head()
        nodes.add(NODE_B, {"prefill": 1, "decode": 1})
        nodes.add(NODE_C, {"decode": 1})
        config = tmp / "cluster.yaml"
        config.write_text(json.dumps(PLACEMENT))
        flags = ["--ray-address", nodes.address, "--host", HEAD_IP, "--http-port", "0", "--grpc-port", "0",
                 "--config", str(config), "--num-blocks", "256", "--num-cpus", "2", "--prefill", "1",
                 "--decode", "2"]
        owner = stack.enter_context(_serve(flags, tmp / "owner.log", timeout_s=600, env=nodes.env))
        base = owner.http_base
        assert nodes.node(NODE_C).actor_titles() == ["DecodeActor"], nodes.node(NODE_C).actor_titles()
        nodes.add(NODE_D, {"decode": 1})  # room for a replacement, joining once serving

        with ThreadPoolExecutor(streams + 1) as pool:  # one more for the probe of serving again
            running = [pool.submit(_outcome, base, p, max_tokens, e) for p, e in zip(prompts, expected)]
            time.sleep(2.0)  # every request is decoding
            killed_at = nodes.node(NODE_C).kill()
            # A new request from the moment of the loss on, until one is answered in full.
            serving = pool.submit(_wait, lambda: _outcome(base, prompts[0], 4, expected[0][:4]) == "identical",
                                  120, 0.2)
            ejected = _wait(lambda: health(base)["workers"]["decode"] == 1, 60, 0.05)
            replaced = _wait(lambda: health(base)["workers"]["decode"] == 2, 300, 0.5)
            outcomes = [f.result(HUNG_S + 60) for f in running]
            served = serving.result(180)
        since = lambda t: None if t is None else round(t - killed_at, 2)  # noqa: E731
        eject_s, replaced_s, serving_s = since(ejected), since(replaced), since(served)
        on_d = nodes.node(NODE_D).actor_titles()
        figures = {"streams": streams, "outcomes": outcomes, "eject_s": eject_s, "replaced_s": replaced_s,
                   "serving_again_s": serving_s, "replacement_on_spare": on_d == ["DecodeActor"]}
        if rejoin:
            nodes.restart(NODE_C)
            nodes.node(NODE_D).kill()
            lost_d = time.monotonic()
            back = _wait(
                lambda: nodes.node(NODE_C).actor_titles() == ["DecodeActor"]
                and health(base)["workers"]["decode"] == 2, 300, 0.5)
            figures["rejoined_replaced_s"] = None if back is None else round(back - lost_d, 2)
            figures["rejoined_node_used"] = nodes.node(NODE_C).actor_titles() == ["DecodeActor"]
            figures["after_rejoin"] = _outcome(base, prompts[1], 16, expected[1][:16])
        return figures


def ratios(figures: dict) -> dict:
    outcomes = figures["outcomes"]
    ok = sum(o in ("identical", "retriable") for o in outcomes)
    return {"identical_or_retriable": ok / len(outcomes), "hung": sum(o.startswith("hung") for o in outcomes),
            "identical": sum(o == "identical" for o in outcomes), "retriable": sum(o == "retriable" for o in outcomes),
            "eject_s": figures["eject_s"], "replaced_s": figures["replaced_s"],
            "serving_again_s": figures["serving_again_s"]}


def _shared_prefix_run(bases: list[str], seed: int, groups: int, per_group: int, concurrency: int,
                       max_tokens: int) -> dict:
    """`groups` x `per_group` prompts (a 64-token prefix per group, then 16 tokens of their own),
    sent round-robin over the fronts in `bases`, `concurrency` at a time; the first of each
    group goes alone first, so every later one could hit. Hit ratio: cached / prompt tokens."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 4096) for _ in range(64)] for _ in range(groups)]
    rest = [[p + [rng.randrange(3, 4096) for _ in range(16)] for _ in range(per_group)] for p in prefixes]
    for i, group in enumerate(rest):  # warm: each group's first prompt through one front
        complete(bases[i % len(bases)], group[0], max_tokens)
    time.sleep(1.0)  # cache events reach the index (published every 50 ms)
    todo = [(bases[i % len(bases)], p) for i, p in enumerate(q for g in rest for q in g[1:])]
    start = time.monotonic()
    with ThreadPoolExecutor(concurrency) as pool:
        usage = list(pool.map(lambda job: complete(job[0], job[1], max_tokens)["usage"], todo))
    wall = time.monotonic() - start
    prompt = sum(u["prompt_tokens"] for u in usage)
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usage)
    return {"requests": len(todo), "wall_s": wall, "requests_per_s": len(todo) / wall, "hit_ratio": cached / prompt}


def two_fronts(tmp: Path, groups: int = 8, per_group: int = 6, concurrency: int = 8, max_tokens: int = 8) -> dict:
    """The same shared-prefix workload through one front, then through two (round-robin over
    both; fresh prompts, so neither run finds the other's blocks) over the same workers:
    2 prefill workers on node B, 1 decode worker on node C, the owner on the head, front B on B."""
    from cluster.redis_server import EmbeddedRedis

    nodes = RayNodes(tmp)
    with nodes.client(), ExitStack() as stack:  # this process's Ray client uses the token too
        stack.callback(nodes.stop)
        redis = stack.enter_context(EmbeddedRedis())
        nodes.start_head()
        nodes.add(NODE_B, {"prefill": 2})
        nodes.add(NODE_C, {"decode": 1})
        config = tmp / "cluster.yaml"
        config.write_text(json.dumps(PLACEMENT))
        common = ["--ray-address", nodes.address, "--http-port", "0", "--grpc-port", "0", "--redis-url", redis.url]
        owner = stack.enter_context(_serve(
            [*common, "--host", HEAD_IP, "--config", str(config), "--num-blocks", "512", "--num-cpus", "2",
             "--prefill", "2", "--decode", "1"], tmp / "owner.log", timeout_s=600, env=nodes.env))
        front = stack.enter_context(_serve([*common, "--host", NODE_B, "--front-only"], tmp / "front.log",
                                                  timeout_s=600, env=nodes.env))
        run = dict(groups=groups, per_group=per_group, concurrency=concurrency, max_tokens=max_tokens)
        one = _shared_prefix_run([owner.http_base], 1, **run)
        two = _shared_prefix_run([owner.http_base, front.http_base], 2, **run)
        return {"one_front": one, "two_fronts": two}
