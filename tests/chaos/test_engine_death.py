"""Chaos: a worker whose engine dies while its actor lives (a real `brigade serve`, `tiny` preset,
1 prefill + 1 decode, an embedded redis-server, BRIGADE_FAULT_INJECTION=1 so the workers take
worker/faults.py's injections).

The decode engine is crashed with two streams in flight (one per front door). Figures, from the
injection: the worker reports not alive, the router ejects it (HTTP /health 503, no live decode
worker) and gRPC health turns NOT_SERVING (target <= 5 s); then the supervisor replaces it and
both doors serve again. The streams end with a retriable error (with one decode worker there is
nowhere to migrate to), never hang; after the replacement the same prompt gives the same tokens.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
import ray
from serve_process import Served, brigade_serve, ray_driver
from support import wait_for

HEALTH_INTERVAL_S = 0.5
GRACE_S = 3.0  # the supervisor's: long enough to see the door NOT_SERVING first
DEADLINE_S = 20.0  # generous: the figure, not this, is held to the 5 s goal
RECOVERY_DEADLINE_S = 120.0  # a new worker loads its model and pairs, on two shared cores
PROMPT = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"prompt": [1, 2, 3], "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("engine_death")
    config = tmp / "cluster.yaml"
    config.write_text(f"router: {{health_interval_s: {HEALTH_INTERVAL_S}}}\n"
                      f"supervisor: {{grace_s: {GRACE_S}, interval_s: 0.5}}\n")
    flags = ["--config", str(config), "--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp / "serve.log", env={"BRIGADE_FAULT_INJECTION": "1"}) as served:
        with ray_driver(served):
            yield served


def http(base: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(base + path, data=data), timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def grpc_health(target: str) -> str:
    from brigade_client import Client

    with Client(target, timeout=5) as client:
        return client.health()


class HttpStream(threading.Thread):
    """A long SSE stream read to its end: the events, and whether it ended with [DONE]."""

    def __init__(self, base: str):
        super().__init__(daemon=True)
        self.resp = urllib.request.urlopen(urllib.request.Request(
            base + "/v1/completions", data=json.dumps(LONG).encode()), timeout=60)
        self.events: list = []
        self.first = threading.Event()

    def run(self) -> None:
        with self.resp:
            for line in self.resp:
                if line.startswith(b"data: "):
                    payload = line[6:].strip()
                    self.events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
                    self.first.set()
        self.first.set()


class GrpcStream(threading.Thread):
    """A long gRPC stream: its token count and the error it ended with (None: it finished)."""

    def __init__(self, target: str):
        super().__init__(daemon=True)
        self.target, self.tokens, self.error = target, 0, None
        self.first = threading.Event()

    def run(self) -> None:
        from brigade_client import Client

        try:
            with Client(self.target, timeout=120, max_retries=0) as client:
                for delta in client.stream(LONG["prompt"], max_tokens=LONG["max_tokens"], temperature=0,
                                           ignore_eos=True):
                    self.tokens += len(delta.token_ids)
                    self.first.set()
        except Exception as exc:  # noqa: BLE001 - what the client got is the result
            self.error = exc
        self.first.set()


def first_time(timeout_s: float, checks: dict) -> dict[str, float]:
    """Poll every check until each has held once; the seconds (from now) each first held
    (the ones that never did within `timeout_s` are missing)."""
    start, found = time.monotonic(), {}

    def all_held() -> bool:
        for name, check in checks.items():
            if name not in found and check():
                found[name] = time.monotonic() - start
        return len(found) == len(checks)
    wait_for(all_held, timeout_s, interval_s=0.02, raise_on_timeout=False)
    return found


@pytest.mark.timeout(300)
def test_a_dead_decode_engine_is_ejected_then_replaced(served: Served, chaos_figure) -> None:
    base, target = served.http_base, served.grpc_target
    status, before = http(base, "/v1/completions", PROMPT)
    assert status == 200, before
    assert http(base, "/health")[0] == 200 and grpc_health(target) == "SERVING"
    decode = ray.get_actor("decode-0")
    with pytest.raises(ray.exceptions.RayTaskError, match="ValueError: kind: unknown fault 'meteor'"):
        ray.get(decode.inject_fault.remote("meteor"))

    streams = [HttpStream(base), GrpcStream(target)]
    for s in streams:
        s.start()
    assert all(s.first.wait(60) for s in streams)
    assert not streams[0].events[-1:] == ["[DONE]"] and streams[1].error is None, "a stream ended before the crash"

    ray.get(decode.inject_fault.remote("engine_crash"))
    down = first_time(DEADLINE_S, {
        "worker_not_alive_s": lambda: not ray.get(decode.health.remote(), timeout=5).alive,
        "router_ejected_s": lambda: http(base, "/health")[1].get("workers", {}).get("decode") == 0,
        "http_503_s": lambda: http(base, "/health")[0] == 503,
        "grpc_not_serving_s": lambda: grpc_health(target) == "NOT_SERVING",
    })
    for s in streams:
        s.join(DEADLINE_S)
    up = first_time(RECOVERY_DEADLINE_S, {
        "http_200_s": lambda: http(base, "/health")[0] == 200,
        "grpc_serving_s": lambda: grpc_health(target) == "SERVING",
    })
    figure = {**down, **{k: down.get("grpc_not_serving_s", 0) + v for k, v in up.items()}}
    print(f"\nengine death: {json.dumps({k: round(v, 2) for k, v in figure.items()})}")
    chaos_figure("engine_death", {"not_serving_s": max(down.values(), default=float("nan"))},
                 {"not_serving_s": "<= 5"}, **figure)

    assert set(down) == {"worker_not_alive_s", "router_ejected_s", "http_503_s", "grpc_not_serving_s"}, down
    http_stream, grpc_stream = streams
    assert not http_stream.is_alive() and not grpc_stream.is_alive(), "a stream hung on the dead engine"
    error = http_stream.events[-1]
    assert "error" in error and "retry" in error["error"]["message"], http_stream.events[-3:]
    assert error["error"]["type"] == "server_error" and "internal error" not in error["error"]["message"]
    assert type(grpc_stream.error).__name__ == "Unavailable", repr(grpc_stream.error)
    assert grpc_stream.error.tokens_sent is not None and grpc_stream.error.tokens_sent >= 1

    assert set(up) == {"http_200_s", "grpc_serving_s"}, up
    assert ray.get(ray.get_actor("decode-1").health.remote()).alive
    status, after = http(base, "/v1/completions", PROMPT)
    assert status == 200 and after["choices"][0]["text"] == before["choices"][0]["text"], after
    from brigade_client import Client

    with Client(target, timeout=60) as client:
        assert client.generate(PROMPT["prompt"], max_tokens=8, temperature=0, ignore_eos=True).text == \
            before["choices"][0]["text"]
