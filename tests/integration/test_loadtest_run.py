"""`brigade bench` end to end against a minimal OpenAI-compatible stub server (tests/openai_stub.py,
stdlib asyncio, nothing from Brigade): the HTTP target speaks only the public protocol. Then the
report renders and two results compare. Everything goes through cli.main(), as the console
script runs it."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from cluster import cli
from loadtest import report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: openai_stub, shared_data
from openai_stub import BLOCK, OpenAIStub  # noqa: E402
from shared_data import shared_data  # noqa: E402


def bench(stub: OpenAIStub, out: Path, *flags: str) -> dict:
    assert cli.main(["bench", "run", "--url", stub.url, "--no-progress", "--output-dir", str(out), *flags]) == 0
    return json.loads((out / "result.json").read_text())


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


SHARED = ["--workload", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "3", "--system-prompt-len",
          str(2 * BLOCK), "--question-len", "8", "--output-len", "4"]


def test_shared_prefix_against_the_stub(tmp_path: Path) -> None:
    with OpenAIStub() as stub:
        result = bench(stub, tmp_path, *SHARED, "--max-concurrency", "1", "--slo", "ttft=10s,tpot=10s")
    run, = result["runs"]
    assert (run["completed"], run["failed"], run["num_prompts"]) == (6, 0, 6)
    # Token-id prompts: system (32) + question (8); standard fields only, usage asked for.
    assert len(stub.bodies) == 6 and set(stub.paths) == {"/v1/completions"}
    # bench asked for the server's step counters before the run; a server without them has no
    # after and the run no server_steps
    assert stub.gets == ["/metrics"] and "server_steps" not in run
    for body in stub.bodies:
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 40
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["max_tokens"] == 4 and "ignore_eos" not in body and "return_token_ids" not in body
    # One request at a time: each group's first prompt misses, the other two hit both system blocks.
    assert run["total_cached_tokens"] == 2 * 2 * 2 * BLOCK
    assert run["cache_hit_ratio"] == pytest.approx(4 * 32 / (6 * 40))
    assert run["total_input_tokens"] == 240 and run["total_output_tokens"] == 24
    for rec in run["records"]:
        assert rec["output_tokens"] == 4 and rec["chunk_tokens"] == [1, 1, 1, 1]
        assert rec["ttft_s"] == rec["chunk_times_s"][0] and len(rec["chunk_times_s"]) == 4
        assert rec["e2e_s"] >= rec["chunk_times_s"][-1]
    assert [len(itl) for itl in run["itls"]] == [3] * 6  # vLLM-style per-request arrays
    assert run["request_goodput"] == pytest.approx(run["request_throughput"])  # generous SLOs: all good


def test_errors_are_counted_by_kind_and_warmup_is_left_out(tmp_path: Path) -> None:
    with OpenAIStub(fail_every=3) as stub:
        result = bench(stub, tmp_path, "--workload", "random", "--num-prompts", "9", "--input-len", "8",
                       "--output-len", "2", "--warmup", "3", "--max-concurrency", "1")
    run, = result["runs"]
    assert len(stub.bodies) == 12  # 3 warm-up + 9 measured
    assert run["num_prompts"] == 9
    assert run["errors_by_kind"] == {"http_503": 3} and run["failed"] == 3  # requests 3, 6, 9, 12 fail; 3 is warm-up
    assert {r["error"] for r in run["records"] if r["error_kind"]} == {"stub overloaded"}


def test_broken_streams_are_errors_of_their_kind(tmp_path: Path) -> None:
    with OpenAIStub(misbehave={1: "error", 2: "abort", 3: "cut"}) as stub:
        result = bench(stub, tmp_path, "--workload", "random", "--num-prompts", "4", "--input-len", "4",
                       "--output-len", "3", "--max-concurrency", "1")
    run, = result["runs"]
    assert run["errors_by_kind"] == {"stream_error": 1, "aborted": 1, "incomplete": 1} and run["completed"] == 1
    assert [r["error"] for r in run["records"]][:1] == ["worker died"]
    assert run["records"][3]["output_tokens"] == 3 and run["mean_ttft_ms"] == run["records"][3]["ttft_s"] * 1000


def test_tokens_are_counted_from_usage_when_their_text_is_empty(tmp_path: Path) -> None:
    """One-token answers whose token ends inside a UTF-8 character stream no text: usage says 1
    token, and that is what counts (not a failure that 'carried no tokens')."""
    with OpenAIStub(misbehave=dict.fromkeys(range(1, 7), "empty")) as stub:
        run, = bench(stub, tmp_path, "--num-prompts", "6", "--input-len", "8", "--output-len", "1")["runs"]
    assert (run["completed"], run["failed"]) == (6, 0)
    assert run["total_output_tokens"] == 6
    for rec in run["records"]:
        assert rec["output_tokens"] == 1 and rec["chunk_tokens"] == [1] and rec["ttft_s"] is not None


def test_trace_replay_shares_the_prefixes_its_hash_ids_share(tmp_path: Path, capsys) -> None:
    trace = shared_data("mooncake_conversation_trace.jsonl")
    with OpenAIStub() as stub:  # the live progress display on (stderr), as a person runs it
        assert cli.main(["bench", "run", "--url", stub.url, "--output-dir", str(tmp_path), "--workload", "trace",
                         "--trace-file", str(trace), "--num-prompts", "5", "--trace-length-scale", "0.03125",
                         "--trace-output-scale", "0.01", "--trace-time-scale", "0.001", "--max-concurrency", "1"]) == 0
    assert "5/5" in capsys.readouterr().err
    run, = json.loads((tmp_path / "result.json").read_text())["runs"]
    # The trace's first five requests share only hash id 0: a 16-token block after the first request.
    assert [r["cached_tokens"] for r in run["records"]] == [0, 16, 16, 16, 16]
    assert [b["prompt"][:16] for b in stub.bodies] == [stub.bodies[0]["prompt"][:16]] * 5
    assert [len(b["prompt"]) for b in stub.bodies] == [212, 229, 227, 72, 212]  # ceil(input_length / 32)
    assert [b["max_tokens"] for b in stub.bodies] == [5, 5, 8, 3, 1]  # output_length x 0.01, at least 1


def test_duration_bounds_the_sessions_started(tmp_path: Path) -> None:
    with OpenAIStub() as stub:
        result = bench(stub, tmp_path, "--workload", "random", "--num-prompts", "10", "--input-len", "4",
                       "--output-len", "1", "--arrival", "fixed", "--request-rate", "4", "--duration", "0.6")
    assert result["runs"][0]["num_prompts"] == 3 == len(stub.bodies)  # offsets 0, 0.25, 0.5 start; 0.75 on do not


def test_multi_turn_resends_the_history_with_the_servers_answers(tmp_path: Path) -> None:
    with OpenAIStub() as stub:
        bench(stub, tmp_path, "--workload", "multi-turn", "--num-sessions", "1", "--num-turns", "3",
              "--input-len", "5", "--output-len", "3", "--think-time", "0", "--return-token-ids")
    first, second, third = (b["prompt"] for b in stub.bodies)
    assert len(first) == 5 and stub.bodies[0]["return_token_ids"] is True
    assert second[:5] == first and second[5:8] == [100, 101, 102] and len(second) == 13  # q1, a1 (the ids), q2
    assert third[:13] == second and third[13:16] == [100, 101, 102]


def test_chat_endpoint_with_text_prompts(tmp_path: Path) -> None:
    with OpenAIStub() as stub:
        result = bench(stub, tmp_path, "--workload", "multi-turn", "--num-sessions", "2", "--num-turns", "2",
                       "--input-len", "6", "--output-len", "2", "--think-time", "0", "--endpoint", "chat",
                       "--model", "stub-model")
    assert result["runs"][0]["completed"] == 4
    assert set(stub.paths) == {"/v1/chat/completions"}
    later = [b for b in stub.bodies if len(b["messages"]) == 3]
    assert len(later) == 2 and all(b["model"] == "stub-model" for b in stub.bodies)
    for body in later:
        user, answer, again = body["messages"]
        assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user"]
        assert len(user["content"].split()) == 6 and answer["content"] == "w0 w1 "


def test_sweep_report_and_compare(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    with OpenAIStub() as stub:
        a = bench(stub, tmp_path / "a", *SHARED, "--request-rate", "50,inf", "--slo", "ttft=5s", "--label", "A")
        bench(stub, tmp_path / "b", *SHARED, "--request-rate", "50,inf", "--max-concurrency", "2")
    assert [r["request_rate"] for r in a["runs"]] == [50, float("inf")]
    assert [r["seed"] for r in a["runs"]] == [0, 1]  # each rate its own prompts: no cross-run cache hits
    first_prompts = {tuple(b["prompt"]) for b in stub.bodies[:6]}
    assert not first_prompts & {tuple(b["prompt"]) for b in stub.bodies[6:12]}

    html = (tmp_path / "a" / "report.html").read_text()
    for png in ("latency_cdfs.png", "sweep.png", "over_time_0.png", "over_time_1.png"):
        path = tmp_path / "a" / png
        assert path.stat().st_size > 1000 and png_size(path) == (800, 450)
        assert f'src="{png}"' in html
    assert "p99 TTFT ms" in html and "ttft_ms" in html

    loaded = report.load(tmp_path / "a" / "result.json")  # records come back typed
    assert loaded["runs"][1]["records"][0].ok and loaded["runs"][1]["request_rate"] == float("inf")

    capsys.readouterr()
    assert cli.main(["bench", "compare", str(tmp_path / "a" / "result.json"), str(tmp_path / "a" / "result.json")]) == 0
    table = capsys.readouterr().out
    assert table.count("1.00x") >= 2 * 10 and "p99 TTFT ms" in table  # A against itself: every ratio is 1

    (tmp_path / "a" / "report.html").unlink()
    assert cli.main(["bench", "report", str(tmp_path / "a" / "result.json")]) == 0
    assert (tmp_path / "a" / "report.html").read_text() == html


def test_bad_flags_are_one_line_naming_the_flag(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cases = [
        (["--workload", "random", "--num-groups", "2"], "--num-groups applies to --workload shared-prefix"),
        (["--slo", "ttft=fast"], "--slo: bad SLO 'ttft=fast'"),
        (["--request-rate", "0"], "--request-rate: request rates must be > 0"),
        (["--input-len", "0"], "--input-len: bad length '0'"),
        (["--endpoint", "chat", "--prompt-format", "ids"], "the chat endpoint takes text"),
        (["--arrival", "trace"], "--arrival trace needs --workload trace"),
        (["--workload", "trace"], "--trace-file: Field required"),
        (["--request-rate", "fast"], "expected rates like 1,2,4 or inf"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", "run", "--output-dir", str(tmp_path), *flags])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith("error: ") and message in err, (flags, err)
        assert err.count("\n") == 1
    with pytest.raises(SystemExit):
        cli.main(["bench", "compare", str(tmp_path / "missing.json"), str(tmp_path / "missing.json")])
    assert "no such file" in capsys.readouterr().err


def test_an_unreachable_server_is_an_error_kind_not_a_crash(tmp_path: Path) -> None:
    assert cli.main(["bench", "run", "--url", "http://127.0.0.1:9", "--no-progress", "--output-dir", str(tmp_path),
                     "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]) == 0
    run, = json.loads((tmp_path / "result.json").read_text())["runs"]
    assert run["errors_by_kind"] == {"connection": 2} and run["completed"] == 0


def test_the_load_generator_needs_no_engine_torch_or_ray() -> None:
    """`brigade bench` runs on a client machine: it imports none of the serving stack."""
    import subprocess

    code = ("import json, sys; import loadtest.cli, loadtest.runner, loadtest.report, loadtest.compare, "
            "loadtest.targets.openai_http; print(json.dumps(sorted({m.partition('.')[0] for m in sys.modules})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "loadtest" in loaded and not loaded & {"engine", "torch", "ray", "redis", "router"}
