"""`brigade bench --backend brigade-grpc`: the target drives the brigade-client SDK's AsyncClient.

First against a stand-in Brigade gRPC service in this process (the SDK's generated stubs; it
streams one token a chunk and can refuse a request), then against a real `brigade serve
--grpc-port 0`.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from brigade_client.v1 import brigade_pb2 as pb
from brigade_client.v1 import brigade_pb2_grpc
from serve_process import brigade_serve

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


class StandIn(brigade_pb2_grpc.BrigadeServicer):
    """Streams max_tokens one-token chunks (ids 100, 101, ...); refuses the `refuse`-th request."""

    def __init__(self, refuse: int = 0):
        self.requests: list[pb.GenerateRequest] = []
        self.refuse = refuse

    def Generate(self, request, context):
        self.requests.append(request)
        if len(self.requests) == self.refuse:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        n = request.sampling.max_tokens
        for i in range(n):
            chunk = pb.GenerateChunk(request_id="r", token_ids=[100 + i], text=f"w{i} ", finished=i == n - 1)
            if chunk.finished:
                chunk.finish_reason = "length"
                chunk.usage.prompt_tokens = len(request.token_ids.ids)
                chunk.usage.completion_tokens = n
                chunk.usage.cached_tokens = 4
            yield chunk


def bench(target: str, out: Path, *flags: str) -> dict:
    assert cli.main(["bench", "run", "--backend", "brigade-grpc", "--url", target, "--no-progress",
                     "--output-dir", str(out), *flags]) == 0
    return json.loads((out / "result.json").read_text())


def test_multi_turn_through_the_sdk_against_a_stand_in(tmp_path: Path) -> None:
    service = StandIn(refuse=3)
    server = grpc.server(futures.ThreadPoolExecutor(4))
    brigade_pb2_grpc.add_BrigadeServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        result = bench(f"127.0.0.1:{port}", tmp_path, "--workload", "multi-turn", "--num-sessions", "2",
                       "--num-turns", "2", "--input-len", "5", "--output-len", "3", "--think-time", "0",
                       "--max-concurrency", "1", "--ignore-eos")
    finally:
        server.stop(0)
    run, = result["runs"]
    # One at a time: s0 t0, s1 t0, s0 t1 (refused, and not retried by the SDK: a load test must see
    # it; session 0 ends there), s1 t1.
    assert len(service.requests) == 4
    assert run["errors_by_kind"] == {"grpc_resource_exhausted": 1} and run["completed"] == 3
    first, _, third, _ = service.requests
    assert len(first.token_ids.ids) == 5 and first.sampling.max_tokens == 3 and first.sampling.ignore_eos
    assert list(third.token_ids.ids[5:8]) == [100, 101, 102]  # the answer's ids resent, then the next question
    assert third.session_id == first.session_id
    assert all(r["cached_tokens"] == 4 and r["chunk_tokens"] == [1, 1, 1] for r in run["records"] if not r["error"])


@pytest.fixture(scope="module")
def grpc_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp_path_factory.mktemp("serve") / "serve.log") as served:
        yield served.grpc_target


def test_shared_prefix_over_grpc_against_brigade_serve(grpc_target: str, tmp_path: Path) -> None:
    result = bench(grpc_target, tmp_path, "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group",
                   "2", "--system-prompt-len", "48", "--question-len", "8", "--output-len", "4",
                   "--max-concurrency", "1", "--ignore-eos")
    run, = result["runs"]
    assert (run["completed"], run["failed"]) == (4, 0), run["errors_by_kind"]
    assert all(r["prompt_tokens"] == 56 and r["output_tokens"] == 4 == sum(r["chunk_tokens"])
               for r in run["records"])
    by_id = {r["session_id"]: r for r in run["records"]}
    assert by_id["group0-q1"]["cached_tokens"] >= 32 and by_id["group1-q1"]["cached_tokens"] >= 32
