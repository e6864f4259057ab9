"""`brigade bench` against a real `brigade serve` (local Ray, router, one prefill and one decode
worker, embedded redis-server) over its OpenAI-compatible HTTP API. Kept small: the tiny preset,
a handful of requests, one server for the module."""
from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serve_process import brigade_serve

from cluster import cli

ROOT = Path(__file__).resolve().parents[2]
SERVE = [sys.executable, "-m", "cluster.cli", "serve", "--http-port", "0", "--num-blocks", "256"]
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp_path_factory.mktemp("serve") / "serve.log") as served:
        yield served.http_base


def bench(url: str, out: Path, *flags: str) -> dict:
    assert cli.main(["bench", "run", "--url", url, "--no-progress", "--output-dir", str(out), "--ignore-eos",
                     "--return-token-ids", *flags]) == 0
    return json.loads((out / "result.json").read_text())


def test_shared_prefix_against_brigade_serve(base_url: str, tmp_path: Path) -> None:
    result = bench(base_url, tmp_path, "--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2",
                   "--system-prompt-len", "48", "--question-len", "8", "--output-len", "4", "--max-concurrency", "1",
                   "--slo", "ttft=60s")
    run, = result["runs"]
    assert (run["completed"], run["failed"]) == (4, 0), run["errors_by_kind"]
    for rec in run["records"]:
        assert rec["prompt_tokens"] == 56 and rec["output_tokens"] == 4  # the server's usage
        assert sum(rec["chunk_tokens"]) == 4 and rec["ttft_s"] <= rec["e2e_s"]
    # Brigade reports cached prompt tokens: each group's second question reuses its system prompt's blocks.
    by_id = {r["session_id"]: r for r in run["records"]}
    assert by_id["group0-q0"]["cached_tokens"] == 0 and by_id["group1-q0"]["cached_tokens"] == 0
    assert by_id["group0-q1"]["cached_tokens"] >= 32 and by_id["group1-q1"]["cached_tokens"] >= 32
    assert run["cache_hit_ratio"] > 0 and run["request_goodput"] == pytest.approx(run["request_throughput"])
    # What the workers' steps took during the run, from /metrics before and after it: one at a
    # time, each request's prompt is one step on the prefill worker, and its 3 tokens after the
    # first are 3 decode steps alone on the decode worker.
    steps = run["server_steps"]
    prompt = {w: sum(t["steps"] for t in kinds.get("prompt", {}).values()) for w, kinds in steps.items()}
    decode = {w: kinds.get("decode", {}) for w, kinds in steps.items()}
    assert sorted(prompt.values()) == [0, 4] and sorted(sum(t["steps"] for t in d.values())
                                                          for d in decode.values()) == [0, 12]
    assert all(set(d) <= {"1"} for d in decode.values())
    assert all(0 < t["cpu_s"] and 0 < t["wall_s"] for kinds in steps.values() for k in kinds.values()
               for t in k.values())


def test_multi_turn_and_text_prompts_against_brigade_serve(base_url: str, tmp_path: Path) -> None:
    result = bench(base_url, tmp_path / "ids", "--workload", "multi-turn", "--num-sessions", "2", "--num-turns", "2",
                   "--input-len", "6", "--output-len", "3", "--think-time", "0")
    run, = result["runs"]
    assert run["completed"] == 4 and run["failed"] == 0
    turns = sorted(run["records"], key=lambda r: (r["session_id"], r["turn"]))
    assert [r["prompt_tokens"] for r in turns] == [6, 15, 6, 15]  # q1 + a1 (3 ids) + q2
    text = bench(base_url, tmp_path / "text", "--workload", "random", "--num-prompts", "3", "--input-len", "5",
                 "--output-len", "2", "--prompt-format", "text")
    assert text["runs"][0]["completed"] == 3 and text["runs"][0]["total_output_tokens"] == 6
