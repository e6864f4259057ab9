"""`brigade serve` end to end: the real cluster (local Ray, router, one prefill and one decode
worker paired over gloo, an embedded redis-server) behind the HTTP API, as `make serve` runs it.

One server process serves the whole module (start-up dominates on two shared cores); the
SIGTERM test stops it, so it comes last. Config parsing and bad flags are checked in this
process (no Ray), through cli.main() — the code path the console script runs.
"""
from __future__ import annotations

import ipaddress
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from serve_process import RAY_ENV, Served, brigade_serve, door_in_flight
from support import wait_for

from cluster import cli
from cluster.config import PER_WORKER, ClusterConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
# A drain long enough for the SIGTERM test's 1,500 tokens on a slow, busy 2-core machine.
DRAIN_S = 120.0
SERVE = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", "256", "--drain-s", f"{DRAIN_S:g}"]
SERVE_CMD = [sys.executable, "-m", "cluster.cli", "serve", *SERVE]
TEXT = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
IDS = {"prompt": [1, 2, 3], "max_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    with brigade_serve(SERVE, tmp_path_factory.mktemp("serve") / "serve.log") as served:
        yield served


@pytest.fixture(scope="module")
def reference(torch_single_thread) -> dict[str, list[int]]:
    """Greedy tokens of the single-process engine for TEXT and IDS."""
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", cache=CacheConfig(num_blocks=256)))
    outs = engine.generate([TEXT["prompt"], IDS["prompt"]],
                           [SamplingParams(max_tokens=8, temperature=0),
                            SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)])
    return {"text": outs[0].token_ids, "ids": outs[1].token_ids}


def _request(url: str, body: dict | bytes | None = None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=60) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def _stream(url: str, body: dict):
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode())
    return urllib.request.urlopen(req, timeout=60)


def _events(lines) -> list:
    """An SSE stream's payloads in order; the literal [DONE] stays a string."""
    events = []
    for line in lines:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append(payload.decode() if payload == b"[DONE]" else json.loads(payload))
    return events


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# -- the server --------------------------------------------------------------------------------


def test_prints_the_resolved_config_then_the_ready_line(server: Served) -> None:
    assert server.out[0].startswith("# brigade serve: resolved config")
    import yaml

    printed = ClusterConfig.model_validate(yaml.safe_load("".join(server.out[1:-1])))
    assert printed == ClusterConfig(http_port=0, grpc_port=0, drain_s=DRAIN_S,  # brigade_serve pins float32
                                    engine={"dtype": "float32", "cache": {"num_blocks": 256}})
    assert server.out[-1].startswith("Brigade serving tiny at http://127.0.0.1:")
    assert " and grpc://127.0.0.1:" in server.out[-1]
    assert server.out[-1].rstrip().endswith(" (1 prefill, 1 decode, disaggregated)")


def test_the_grpc_door_serves_the_same_tokens(server: Served, reference) -> None:
    from brigade_client import Client

    target = server.grpc_target
    with Client(target, timeout=60) as client:
        assert client.health() == "SERVING"
        done = client.generate(TEXT["prompt"], max_tokens=8, temperature=0)
        assert done.token_ids == reference["text"] and done.finish_reason == "length"


def _idle_health(base: str, timeout_s: float = 10.0) -> tuple[int, dict]:
    """/health once the router has let go of earlier tests' requests: it counts a stream as
    running until its generator has closed, a moment after the client read the last chunk."""
    def idle() -> tuple[int, dict] | None:
        status, health, _ = _request(f"{base}/health")
        return (status, health) if health.get("running") == 0 else None
    return wait_for(idle, timeout_s, "the router idle", 0.05)


def test_completions_match_the_single_process_engine(server: Served, reference) -> None:
    status, health = _idle_health(server.http_base)
    health.pop("peak")  # the router's high-water marks, checked below
    assert (status, health) == (200, {
        "status": "ok", "workers": {"prefill": 1, "decode": 1}, "running": 0, "waiting": 0, "prefix_index": "ok"})
    status, models, _ = _request(f"{server.http_base}/v1/models")
    assert status == 200 and models["data"][0]["id"] == "tiny"

    for body, expected in ((TEXT, reference["text"]), (IDS, reference["ids"])):
        status, done, _ = _request(f"{server.http_base}/v1/completions", {**body, "return_token_ids": True})
        assert status == 200, done
        choice = done["choices"][0]
        assert choice["token_ids"] == expected
        assert choice["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == len(expected)

        with _stream(f"{server.http_base}/v1/completions",
                     {**body, "return_token_ids": True, "stream_options": {"include_usage": True}}) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            events = _events(resp)
        assert events[-1] == "[DONE]"
        chunks, usage = events[:-2], events[-2]["usage"]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected
        assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert usage == done["usage"]
    peak = _request(f"{server.http_base}/health")[1]["peak"]
    assert peak["running"] >= 1 and 0 <= peak["waiting"] <= ClusterConfig().router.max_waiting, peak


def test_bad_requests_get_openai_errors(server: Served) -> None:
    status, err, _ = _request(f"{server.http_base}/v1/completions", {"prompt": [1, 2, 3], "temperature": -1})
    assert status == 400 and err["error"]["param"] == "temperature", err
    assert err["error"]["type"] == "invalid_request_error"
    status, err, _ = _request(f"{server.http_base}/v1/completions", {"prompt": [1, 99999]})
    assert status == 400 and err["error"]["param"] == "prompt" and "99999" in err["error"]["message"]
    status, err, _ = _request(f"{server.http_base}/v1/completions", {"prompt": [1], "max_tokens": 5000})
    assert status == 400 and err["error"]["param"] == "max_tokens"
    assert _request(f"{server.http_base}/v1/completions", b"{not json")[0] == 400
    assert _request(f"{server.http_base}/v1/completions", {"model": "gpt-4", "prompt": "x"})[0] == 404
    assert _request(f"{server.http_base}/v1/nope")[0] == 404


def test_a_client_that_leaves_frees_its_request(server: Served) -> None:
    resp = _stream(f"{server.http_base}/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4000,
                                                     "ignore_eos": True, "temperature": 0})
    assert resp.readline().startswith(b"data: {")
    resp.close()  # the server notices at its next write, aborts, and the router's slot comes back
    # 4000 tokens take three times 5 s here: only an abort ends it so soon
    wait_for(lambda: _request(f"{server.http_base}/health")[1]["running"] == 0, 5, "the router's slot back", 0.2)
    # and the door's handler too, once the abort is confirmed (backend ABORT_DRAIN_S bounds it)
    wait_for(lambda: door_in_flight(server) == 0, 10, "the door's handler done", 0.2)


def test_no_listening_socket_binds_a_wildcard_address(server: Served) -> None:
    """The serve process and all its descendants: Ray's GCS, raylet and agents, the actors
    (their gRPC servers, gloo pair sockets, the KV rendezvous store) and redis-server."""
    listening, names = [], []
    for p in _tree(server.proc.pid):
        try:
            cmd = " ".join(p.cmdline())
            listening += [(cmd[:60], c.laddr) for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            names.append(cmd)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    for needed in ("redis-server", "gcs_server", "raylet", "ray::RouterActor", "ray::PrefillActor",
                   "ray::DecodeActor"):
        assert any(needed in n for n in names), f"no {needed} among the server's processes"
    assert any(addr.port == int(server.http_base.rsplit(":", 1)[1]) for _, addr in listening)
    wild = [(cmd, addr) for cmd, addr in listening if not _loopback(addr.ip)]
    assert not wild, wild


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_loopback or bool(getattr(addr, "ipv4_mapped", None) and addr.ipv4_mapped.is_loopback)


def test_sigterm_drains_in_flight_requests_and_exits_0(server: Served) -> None:
    procs = _tree(server.proc.pid)
    assert any("redis-server" in " ".join(p.cmdline()) for p in procs)
    # "draining 1" below counts the door's requests: none of the earlier tests' may still be in it
    wait_for(lambda: door_in_flight(server) == 0, 10, "the door idle before the test", 0.2)
    with _stream(f"{server.http_base}/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1500,
                                                   "ignore_eos": True, "temperature": 0}) as resp:
        assert resp.readline().startswith(b"data: {")
        server.proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        rest = _events(resp)
    assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
    assert server.proc.wait(timeout=DRAIN_S + 60) == 0
    assert time.monotonic() - start < DRAIN_S + 60
    log = server.log.read_text()
    assert f"draining 1 request(s) in flight (up to {DRAIN_S:g} s)" in log and "stopped" in log
    wait_for(lambda: all(_gone(p) for p in procs), 10,
             lambda: f"every process gone; left: {[' '.join(p.cmdline())[:80] for p in procs if not _gone(p)]}", 0.2)


# -- config and flags (no Ray) -----------------------------------------------------------------


def _serve_config(*argv: str) -> ClusterConfig:
    return cli.cluster_config(cli.build_parser().parse_args(["serve", *argv]))


def test_config_file_then_flags(tmp_path: Path) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text("model: tiny-moe\nprefill: 2\ndecode: 3\nengine:\n  cache:\n    block_size: 8\n"
                    "    num_blocks: 128\nrouter:\n  max_waiting: 7\n")
    cfg = _serve_config("--config", str(path), "--decode", "1", "--num-blocks", "64", "--http-port", "9001")
    assert (cfg.model, cfg.prefill, cfg.decode, cfg.http_port) == ("tiny-moe", 2, 1, 9001)
    assert (cfg.engine.cache.block_size, cfg.engine.cache.num_blocks) == (8, 64)  # a flag replaces one field
    assert cfg.engine.model == "tiny-moe"  # the top-level model is the engine's
    assert cfg.router.max_waiting == 7
    assert _serve_config() == ClusterConfig()  # no file, no flags: the defaults
    assert _serve_config("--mode", "colocated", "--decode", "2").num_prefill == 0
    cfg = _serve_config("--policy", "round_robin", "--redis-prefix", "tenant-a")
    assert (cfg.router.policy, cfg.index.key_prefix) == ("round_robin", "tenant-a")
    path.write_text("drain_s: 45\n")
    assert _serve_config("--config", str(path)).drain_s == 45
    assert _serve_config("--config", str(path), "--drain-s", "300").drain_s == 300


def test_the_example_config_lists_every_field_at_its_default() -> None:
    example = ROOT / "cluster.example.yaml"
    assert load_config(example, {}) == ClusterConfig()
    text = example.read_text()
    for name, field in ClusterConfig.model_fields.items():
        assert f"\n{name}:" in f"\n{text}", name
        sub = getattr(field.annotation, "model_fields", {})
        for inner in sub:
            if name == "engine" and inner in PER_WORKER:
                assert f"\n  {inner}:" not in text, f"{name}.{inner} is set per worker"
                continue
            assert f"\n  {inner}:" in text, f"{name}.{inner}"


BAD_SERVE = {
    # name: (argv, config file text or None, what the one error line must say)
    "unknown key": ([], "model: tiny\nenigne:\n  num_blocks: 4\n", "unknown key 'enigne' in"),
    "unknown nested key": ([], "engine:\n  num_blockz: 4\n", "unknown key 'engine.num_blockz'"),
    "bad value in the file": ([], "engine:\n  cache:\n    block_size: 0\n", "engine.cache.block_size (in"),
    "a per-worker engine field": ([], "engine:\n  role: prefill\n", "engine.role is set per worker"),
    "not YAML": ([], "model: [tiny\n", "not valid YAML"),
    "flag over a bad file value": (["--block-size", "0"], None, "--block-size: Input should be greater"),
    "missing file": (["--config", "/nonexistent/cluster.yaml"], None, "cannot read config file"),
    "mode": (["--mode", "mixed"], None, "argument --mode: invalid choice"),
    "no decode": (["--decode", "0"], None, "--decode: Input should be greater than or equal to 1"),
    "no prefill": (["--prefill", "0"], None, "disaggregated mode needs at least one prefill worker"),
    "wildcard host": (["--host", "0.0.0.0"], None, "not a wildcard"),
    "wildcard host 0": (["--host", "0"], None, "not a wildcard"),
    "wildcard host ::0": (["--host", "::0"], None, "not a wildcard"),
    "grpc port": (["--grpc-port", "70000"], None, "--grpc-port: Input should be less than or equal to 65535"),
    "not a number": (["--prefill", "two"], None, "argument --prefill: invalid int value"),
    "policy": (["--policy", "fastest"], None, "argument --policy: invalid choice"),
    "redis prefix": (["--redis-prefix", "a b"], None, "--redis-prefix: String should match pattern"),
    "no drain": (["--drain-s", "0"], None, "--drain-s: Input should be greater than 0"),
}


@pytest.mark.parametrize("name", BAD_SERVE)
def test_bad_config_or_flag_is_one_error_line_and_exit_2(name: str, tmp_path: Path, capsys) -> None:
    argv, text, expected = BAD_SERVE[name]
    if text is not None:
        (tmp_path / "c.yaml").write_text(text)
        argv = ["--config", str(tmp_path / "c.yaml"), *argv]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", *argv])
    out, err = capsys.readouterr()
    assert exit_info.value.code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert expected in err and "Traceback" not in err


def test_a_bad_flag_in_a_real_process_exits_2() -> None:
    proc = subprocess.run([*SERVE_CMD, "--mode", "mixed"], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **RAY_ENV})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: argument --mode") and proc.stderr.count("\n") == 1


def test_a_bad_model_fails_before_anything_starts(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--model", "no-such-preset", "--http-port", "0", "--grpc-port", "0"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith("error: model 'no-such-preset' is neither a preset")


def test_an_impossible_placement_is_one_error_line_after_ray_starts() -> None:
    """Placements need Ray's view of the resources; the local Ray it started is stopped again."""
    proc = subprocess.run([*SERVE_CMD, "--device", "cuda", "--prefill", "64", "--decode", "64"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **RAY_ENV})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1].startswith("error: 128 workers need 128 GPUs; the Ray cluster has")


def test_a_taken_port_fails_before_anything_starts(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--http-port", str(port)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (f"error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                                       "pick another --http-port or --host\n")
    assert time.monotonic() - start < 10  # no Ray, no Redis, no model


BAD_FRONTDOOR = {
    "auth env unset": ("frontdoor:\n  auth:\n    token_env: BRIGADE_TEST_NO_SUCH_VAR\n",
                       "error: auth.token_env names $BRIGADE_TEST_NO_SUCH_VAR, which is unset or empty"),
    "auth file missing": ("frontdoor:\n  auth:\n    token_file: /nonexistent/tokens\n",
                          "error: auth.token_file /nonexistent/tokens: No such file or directory"),
    "tls files missing": ("frontdoor:\n  tls:\n    cert_file: /nonexistent/c.pem\n    key_file: /nonexistent/k.pem\n",
                          "error: frontdoor.tls: cannot load cert_file /nonexistent/c.pem with key_file"),
}


@pytest.mark.parametrize("name", BAD_FRONTDOOR)
def test_bad_frontdoor_setup_fails_before_anything_starts(name: str, tmp_path: Path, capsys) -> None:
    text, expected = BAD_FRONTDOOR[name]
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--http-port", "0", "--config", str(tmp_path / "c.yaml")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert err.startswith(expected), err


def test_a_taken_grpc_port_fails_before_anything_starts(capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--http-port", "0", "--grpc-port", str(port)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot listen for gRPC on 127.0.0.1:{port}: the port is in use") and \
        err.endswith("pick another --grpc-port or --host\n")


# -- the HTTP front door over a stand-in backend (no Ray, no model) -----------------------------


class FakeBackend:
    """Answers with a fixed two-chunk stream, or raises what `fail` names at admission."""

    model_name, max_model_len = "fake", 64

    def __init__(self) -> None:
        self.fail: Exception | None = None
        self.healthy = True
        self.closed: list[str] = []
        self.salts: list[str | None] = []

    def tokenize(self, prompt):
        return [ord(c) for c in prompt] if isinstance(prompt, str) else prompt

    def validate(self, token_ids, params) -> None:
        pass

    async def generate(self, req):
        from engine.messages import Chunk
        from engine.outputs import Usage

        request_id, token_ids = req.request_id, req.prompt_token_ids
        self.salts.append(req.cache_salt)
        if self.fail is not None:
            raise self.fail
        try:
            yield Chunk(request_id, [1], "a")
            yield Chunk(request_id, [2], "b", True, "length", Usage(len(token_ids), 2, 0))
        finally:
            self.closed.append(request_id)

    async def health(self):
        return self.healthy, {} if self.healthy else {"reason": "no live decode worker"}

    async def worker_stats(self):
        return {}


@pytest.fixture
def fake_server() -> Iterator[tuple[str, FakeBackend, object]]:
    import threading

    from router.http.server import ApiServer

    server = ApiServer("127.0.0.1", 0)
    server.backend = backend = FakeBackend()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.url, backend, server
    finally:
        server.shutdown()
        server.server_close()


def test_front_door_maps_router_errors_to_retriable_statuses(fake_server) -> None:
    from router.errors import NoWorker, Overloaded

    url, backend, server = fake_server
    status, done, _ = _request(f"{url}/v1/completions", {"prompt": "hi", "return_token_ids": True})
    assert status == 200 and (done["choices"][0]["text"], done["choices"][0]["token_ids"]) == ("ab", [1, 2])
    assert done["usage"]["prompt_tokens"] == 2
    wait_for(lambda: backend.closed, 5, "the handler closing the stream after replying", 0.01)
    assert len(backend.closed) == 1

    backend.fail = Overloaded("overloaded: 9 requests waiting; retry later")
    status, err, headers = _request(f"{url}/v1/completions", {"prompt": "hi", "stream": True})
    assert (status, headers.get("Retry-After"), err["error"]["type"]) == (429, "1", "rate_limit_error")
    backend.fail = NoWorker("no live decode worker can take the request; retry shortly")
    status, err, headers = _request(f"{url}/v1/completions", {"prompt": "hi"})
    assert (status, headers.get("Retry-After"), err["error"]["type"]) == (503, "1", "server_error")
    assert "no live decode worker" in err["error"]["message"]

    backend.healthy = False
    status, health, headers = _request(f"{url}/health")
    assert (status, health, headers.get("Retry-After")) == (503, {"status": "unavailable",
                                                                   "reason": "no live decode worker"}, "1")
    server.draining.set()
    assert _request(f"{url}/health")[:2] == (503, {"status": "draining"})
    status, err, headers = _request(f"{url}/v1/completions", {"prompt": "hi"})
    assert status == 503 and headers.get("Retry-After") == "1" and "shutting down" in err["error"]["message"]


def test_the_cache_salt_reaches_the_backend_and_a_bad_one_is_400(fake_server) -> None:
    url, backend, _ = fake_server
    status, _, _ = _request(f"{url}/v1/completions", {"prompt": "hi", "cache_salt": "tenant-a"})
    status2, _, _ = _request(f"{url}/v1/completions", {"prompt": "hi"})
    # auth is off: the default tenant's own salt is scoped under it (router.auth.cache_salt)
    assert (status, status2) == (200, 200) and backend.salts == ["default:tenant-a", None]
    for bad in ("", 7, ["x"]):
        status, err, _ = _request(f"{url}/v1/completions", {"prompt": "hi", "cache_salt": bad})
        assert (status, err["error"]["param"]) == (400, "cache_salt"), bad
    assert backend.salts == ["default:tenant-a", None]  # refused before reaching it
