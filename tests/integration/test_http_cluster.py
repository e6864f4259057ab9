"""The HTTP door over a real cluster (local Ray, router, one prefill and one decode worker over
gloo, the `tiny` preset), called with the official `openai` client, with auth on.

Greedy chat and completion tokens must equal the single-process engine's; cached prompt
tokens surface in `usage`; refused requests never reach a worker; the whole invalid-request
table and a corpus of mutated bodies kill no worker (same actor ids, no engine error); a client
that leaves mid-stream gets its request aborted and every KV block back on both workers.
"""
from __future__ import annotations

import json
import random
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import pytest
import ray
from invalid_cases import CASES, HTTP_CASES, Limits
from support import wait_for

from cluster.backend import ClusterBackend
from cluster.launch import Cluster
from router.auth import Authenticator
from router.http.server import ApiServer
from router.metrics import FrontDoorMetrics

pytestmark = pytest.mark.usefixtures("torch_single_thread")

TOKEN, OTHER = "acme-token-0123456789", "zeta-token-0123456789"
MESSAGES = [{"role": "user", "content": "hello there"}]
NUM_BLOCKS = 256


class CountingBackend(ClusterBackend):
    """The cluster's backend, counting the requests handed to the router."""

    generated = 0

    def generate(self, *args, **kwargs):
        self.generated += 1
        return super().generate(*args, **kwargs)


@dataclass
class Served:
    server: ApiServer
    cluster: Cluster
    backend: CountingBackend
    api: openai.OpenAI


@pytest.fixture(scope="module")
def served(ray_cluster) -> Iterator[Served]:
    cluster = ray_cluster(engine={"cache": {"num_blocks": NUM_BLOCKS}})
    backend = CountingBackend(cluster.cfg)
    server = ApiServer("127.0.0.1", 0, metrics=FrontDoorMetrics(), auth=Authenticator({TOKEN: "acme", OTHER: "zeta"}))
    try:
        backend.attach(cluster)
        server.backend = backend
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key=TOKEN, max_retries=0, timeout=120)
        yield Served(server, cluster, backend, api)
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[str, list[int]]:
    """Greedy tokens of the single-process engine for the chat prompt and a text prompt."""
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    chat_ids = served.backend.chat_token_ids(MESSAGES)
    outs = engine.generate([chat_ids, "once upon a time"], [SamplingParams(max_tokens=8, temperature=0)] * 2)
    return {"chat": outs[0].token_ids, "text": outs[1].token_ids}


def pools_whole(cluster: Cluster, timeout_s: float = 10.0) -> dict:
    def whole() -> dict | None:
        stats = cluster.stats()
        return stats if all(s["free_blocks"] == s["num_blocks"] and s["referenced_blocks"] == 0 and s["running"] == 0
                            and s["waiting"] == 0 and s.get("pinned_exports", 0) == 0 for s in stats.values()) else None
    return wait_for(whole, timeout_s, lambda: f"KV pools whole; now {cluster.stats()}")


@pytest.mark.timeout(240)
def test_chat_and_completions_match_the_engine(served: Served, reference) -> None:
    api = served.api
    done = api.chat.completions.create(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0,
                                       extra_body={"return_token_ids": True})
    assert done.choices[0].token_ids == reference["chat"]
    assert done.usage.completion_tokens == len(reference["chat"])
    assert done.usage.prompt_tokens == len(served.backend.chat_token_ids(MESSAGES))
    events = list(api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8, temperature=0,
                                              stream=True, stream_options={"include_usage": True}))
    assert events[0].choices[0].delta.role == "assistant"
    assert "".join(e.choices[0].delta.content or "" for e in events[:-1]) == done.choices[0].message.content
    assert events[-1].usage.completion_tokens == done.usage.completion_tokens

    whole = api.completions.create(model="tiny", prompt="once upon a time", max_tokens=8, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert whole.choices[0].token_ids == reference["text"]
    streamed = list(api.completions.create(model="tiny", prompt="once upon a time", max_tokens=8, temperature=0,
                                           stream=True))
    assert "".join(e.choices[0].text for e in streamed) == whole.choices[0].text
    assert streamed[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    pools_whole(served.cluster)


@pytest.mark.timeout(120)
def test_repeated_prompt_reports_cached_tokens(served: Served) -> None:
    prompt = list(range(100, 150))  # 50 tokens: three full 16-token blocks can be reused
    first = served.api.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    again = served.api.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens == 50
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    assert again.choices[0].text == first.choices[0].text


@pytest.mark.timeout(120)
def test_chat_logprobs(served: Served) -> None:
    done = served.api.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert (entry.token, entry.logprob) == pytest.approx((entry.top_logprobs[0].token,
                                                              entry.top_logprobs[0].logprob))  # greedy: the best
    assert "".join(e.token for e in content) == done.choices[0].message.content


SOME_CASES = ("empty prompt", "prompt + max_tokens over the context", "token id out of range",
              "temperature negative", "logprobs over the cap", "too many stop strings")


@pytest.mark.timeout(120)
def test_refused_requests_never_reach_a_worker(served: Served) -> None:
    limits = Limits(served.backend.max_model_len, served.backend.vocab_size)
    before = served.backend.generated
    for case in (c for c in CASES if c.name in SOME_CASES):
        with pytest.raises(openai.BadRequestError) as info:
            served.api.completions.create(model="tiny", **case.request(limits))
        assert info.value.body["param"] == case.field, case.name
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=served.api.base_url, api_key="wrong-token-0123456789",
                      max_retries=0).completions.create(model="tiny", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        served.api.completions.create(model="gpt-4", prompt="hi")
    assert served.backend.generated == before
    assert served.api.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    assert served.backend.generated == before + 1


@pytest.mark.timeout(120)
def test_a_client_that_leaves_mid_stream_frees_its_kv(served: Served) -> None:
    def cancelled() -> float:
        served.server.wait_idle(10)
        return served.server.metrics.requests.labels("http", "cancelled")._value.get()

    before = cancelled()
    # 4000 tokens take far longer than the wait for the pools below: only an abort frees them so soon
    body = json.dumps({"model": "tiny", "messages": MESSAGES, "max_tokens": 4000, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    with socket.create_connection(served.server.server_address[:2]) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        got = b""
        while got.count(b"data: {") < 3:  # the role, then tokens: the request is decoding
            data = sock.recv(65536)
            assert data, got
            got += data
        decode = ray.get(served.cluster.router.status.remote())
        assert decode["running"] == 1
    # the server notices at its next write, aborts at the router, and both workers free the KV
    stats = pools_whole(served.cluster)
    assert all(s["free_blocks"] == NUM_BLOCKS for s in stats.values())
    # The router lets go of the request when its generator closes, a moment after the workers did.
    wait_for(lambda: ray.get(served.cluster.router.status.remote())["running"] == 0, 10, "the router idle", 0.05)
    assert cancelled() == before + 1


EXTREMES = [None, True, False, -1, 0, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**400, 1e308, -1e308, 0.5, "",
            "x" * 5000, "\u0000", [], {}, [[]], [2**63], [-1], ["a"] * 100, {"a": [1] * 10}]
BASES = {"/v1/completions": {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0.5,
                             "top_p": 0.9, "top_k": 5, "seed": 1, "stop": ["x"], "logprobs": 2},
         "/v1/chat/completions": {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2,
                                  "stream": True, "stop_token_ids": [3]}}
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "stream", "stream_options", "n", "echo",
          "ignore_eos", "cache_salt", "return_token_ids", "chat_template_kwargs", "documents", "model"]


def fuzz_corpus(rng: random.Random, n: int) -> list[tuple[str, bytes]]:
    """Valid bodies with fields set to extremes, dropped or added, and their bytes flipped,
    truncated or spliced."""
    out = []
    for _ in range(n):
        path = rng.choice(list(BASES))
        body = dict(BASES[path])
        for _ in range(rng.randint(1, 3)):
            name = rng.choice(FIELDS)
            if rng.random() < 0.2:
                body.pop(name, None)
            else:
                body[name] = rng.choice(EXTREMES)
        data = bytearray(json.dumps(body).encode())
        if rng.random() < 0.3:
            at = rng.randrange(len(data))
            op = rng.randrange(3)
            if op == 0:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[at:]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        out.append((path, bytes(data)))
    return out


def workers_fine(cluster: Cluster) -> dict[str, str]:
    """Every worker's actor id, after checking each is alive with no engine error."""
    health = ray.get([h.health.remote() for h in cluster.workers.values()])
    assert all(h.alive and h.error is None for h in health), health
    return {wid: h._actor_id.hex() for wid, h in cluster.workers.items()}


@pytest.mark.timeout(300)
def test_the_invalid_table_and_a_fuzz_corpus_kill_no_worker(served: Served) -> None:
    """Every case of the shared table is refused naming its field, and 600 mutated
    bodies get deliberate answers (no 5xx, none hangs); afterwards the same workers are alive,
    with no engine error, every KV pool whole, and the door serves."""
    actors = workers_fine(served.cluster)
    limits = Limits(served.backend.max_model_len, served.backend.vocab_size)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    with httpx.Client(base_url=served.server.url, headers=headers, timeout=60) as http:
        for case in HTTP_CASES:
            r = http.post("/v1/completions", content=json.dumps(case.request(limits)))
            assert r.status_code == 400 and r.json()["error"]["param"] == case.field, (case.name, r.text)

        def send(item: tuple[str, bytes]) -> int:
            path, data = item
            with http.stream("POST", path, content=data) as r:
                r.read()
                return r.status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(send, fuzz_corpus(random.Random(17), 600)))
    assert max(statuses) < 500, sorted(set(statuses))
    assert statuses.count(200) > 30 and statuses.count(400) > 100, sorted(set(statuses))
    pools_whole(served.cluster, 60)
    wait_for(lambda: ray.get(served.cluster.router.status.remote())["running"] == 0, 30, "the router idle", 0.1)
    assert workers_fine(served.cluster) == actors  # nobody died or was replaced
    assert served.api.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
