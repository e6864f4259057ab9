"""The gRPC front door over a stand-in backend (no Ray, no model): auth, tenants, TLS, status
codes and the SDK's retry rule, health, the CLI, and the client package itself.

The server, channels and SDK are real; only the backend (our own AsyncBackend interface) is
a stand-in, scripted per test.
"""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from brigade_client import (
    BrigadeError,
    Client,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpeculativeUsage,
    Unauthenticated,
    Unavailable,
)
from brigade_client import cli as client_cli
from brigade_client.v1 import brigade_pb2 as pb
from support import wait_for

from engine.messages import Chunk, Timing
from engine.outputs import Usage
from engine.sampling import InvalidRequest
from router.config import AuthConfig, FrontDoorConfig, TLSConfig
from router.errors import NoWorker, Overloaded
from router.grpc.server import GrpcServer
from router.metrics import FrontDoorMetrics

ROOT = Path(__file__).resolve().parents[2]
TOKEN, OTHER = "acme-" + "a" * 20, "zeta-" + "z" * 20


class StandIn:
    """Answers every prompt with tokens [1, 2, 3]; `fail` scripts exceptions, one per call."""

    model_name, max_model_len, vocab_size = "stand-in", 64, 100

    def __init__(self) -> None:
        self.calls: list = []  # the GenerateRequests that reached "the router"
        self.fail: list[Exception] = []  # raised by the next calls, in order, before any chunk
        self.fail_mid_stream: Exception | None = None
        self.healthy = True
        self.spec: tuple[int, int, int] = (0, 0, 0)  # the usage's (draft, accepted, verify steps) tokens

    def tokenize(self, prompt):
        return [7] * len(prompt) if isinstance(prompt, str) else prompt

    def chat_token_ids(self, messages):
        return [8] * len(messages)

    def detokenize(self, ids):
        return ",".join(map(str, ids))

    def validate(self, ids, params) -> None:
        if not ids:
            raise InvalidRequest("prompt", "prompt is empty")

    def output_room(self, ids) -> int:
        return self.max_model_len - len(ids)

    async def generate(self, req):
        self.calls.append(req)
        if self.fail:
            raise self.fail.pop(0)
        for t in (1, 2):
            yield Chunk(req.request_id, [t], f"t{t}")
            if self.fail_mid_stream is not None:
                raise self.fail_mid_stream
        yield Chunk(req.request_id, [3], "t3", True, "length", Usage(len(req.prompt_token_ids), 3, 0, {}, *self.spec),
                    timing=Timing(ttft_s=0.01, total_s=0.02), decode_worker="decode-0")

    async def health(self):
        return self.healthy, {}


def make_door(frontdoor: FrontDoorConfig = FrontDoorConfig()) -> tuple[GrpcServer, StandIn]:
    server = GrpcServer("127.0.0.1", 0, frontdoor, FrontDoorMetrics(), health_interval_s=0.05)
    backend = StandIn()
    server.attach(backend)
    return server, backend


@pytest.fixture
def door():
    server, backend = make_door()
    yield server, backend
    server.close()


@pytest.fixture
def auth_door(monkeypatch):
    monkeypatch.setenv("BRIGADE_TEST_TOKENS", f"acme {TOKEN}, zeta {OTHER}")
    server, backend = make_door(FrontDoorConfig(auth=AuthConfig(token_env="BRIGADE_TEST_TOKENS")))
    yield server, backend
    server.close()


# -- auth and tenants ---------------------------------------------------------------------------

def test_without_auth_callers_share_the_unsalted_chain(door) -> None:
    server, backend = door
    with Client(server.address) as client:
        client.generate("hi")
        client.generate("hi", cache_salt="conv-1", session_id="s-9", priority=2)  # the last two: not used
    assert [r.cache_salt for r in backend.calls] == [None, "default:conv-1"]


def test_auth_refuses_missing_and_unknown_tokens_and_salts_by_tenant(auth_door) -> None:
    server, backend = auth_door
    for token in (None, "not-a-token-at-all-xxxx"):
        with Client(server.address, token=token, max_retries=0) as client:
            for call in (lambda: client.generate("hi"), client.models, lambda: client.tokenize("x"),
                         lambda: list(client.stream("hi"))):
                with pytest.raises(Unauthenticated, match="bearer token"):
                    call()
            assert client.health() == "SERVING"  # public by default: probes carry no token
    assert backend.calls == []
    with Client(server.address, token=TOKEN) as acme, Client(server.address, token=OTHER) as zeta:
        assert acme.generate("hi").token_ids == [1, 2, 3]
        zeta.generate("hi", cache_salt="x")
    assert [r.cache_salt for r in backend.calls] == ["acme", "zeta:x"]
    assert server.state.metrics.requests.labels("grpc", "unauthenticated")._value.get() == 4


def test_an_unauthenticated_call_is_refused_before_its_bytes_are_parsed(auth_door) -> None:
    """A big body, and bytes that are no GenerateRequest at all: UNAUTHENTICATED either way (a
    parse would have said INVALID_ARGUMENT), and nothing reaches the backend."""
    server, backend = auth_door
    with grpc.insecure_channel(server.address) as channel:
        for method in ("GenerateUnary", "Generate"):
            kind = channel.unary_stream if method == "Generate" else channel.unary_unary
            call = kind(f"/brigade.v1.Brigade/{method}")
            for body in (pb.GenerateRequest(text="x" * (1 << 20)).SerializeToString(), b"\xff\xff not a message"):
                with pytest.raises(grpc.RpcError) as info:
                    result = call(body, timeout=30)
                    if method == "Generate":
                        list(result)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, (method, info.value.details())
    assert backend.calls == []


def test_calls_over_max_concurrent_rpcs_are_resource_exhausted_at_once() -> None:
    server, backend = make_door(FrontDoorConfig(max_concurrent_rpcs=2))
    release = threading.Event()

    async def slow(req):
        backend.calls.append(req)
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        yield Chunk(req.request_id, [3], "t3", True, "length", Usage(1, 1, 0))
    backend.generate = slow
    try:
        with Client(server.address, max_retries=0, timeout=30) as client, ThreadPoolExecutor(2) as pool:
            held = [pool.submit(lambda: list(client.stream("hi"))) for _ in range(2)]
            wait_for(lambda: len(backend.calls) >= 2, 20, "both calls in the backend", 0.02)
            with pytest.raises(ResourceExhausted):
                client.generate("hi")  # the third at once: refused, not queued
            release.set()
            assert all(len(f.result(timeout=30)) == 1 for f in held)
            assert len(client.generate("hi").token_ids) == 1  # and served again once they are done
    finally:
        release.set()
        server.close()


def test_health_answers_while_detokenize_calls_hold_their_threads(door) -> None:
    """Detokenize (and Tokenize, templates, a Generate's tokenizing) run off the event loop: with
    8 calls each blocked in the tokenizer, health still answers at once, well inside its deadline."""
    server, backend = door
    release, entered = threading.Event(), threading.Semaphore(0)

    def slow_detokenize(ids):
        entered.release()
        release.wait(60)
        return "x"
    backend.detokenize = slow_detokenize
    try:
        with Client(server.address, max_retries=0, timeout=90) as client, ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(client.detokenize, [1] * 1000) for _ in range(8)]
            for _ in range(4):  # at least 4 inside the tokenizer (the loop's executor takes cores + 4 at once)
                assert entered.acquire(timeout=30)
            with Client(server.address, max_retries=0, timeout=10) as prober:
                assert all(prober.health() == "SERVING" for _ in range(20))  # the loop is free
            release.set()
            assert all(c.result(timeout=60) == "x" for c in calls)
    finally:
        release.set()


def test_reflection_needs_a_token_and_health_too_unless_public(monkeypatch) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    monkeypatch.setenv("BRIGADE_TEST_TOKENS", TOKEN)
    server, _ = make_door(FrontDoorConfig(auth=AuthConfig(token_env="BRIGADE_TEST_TOKENS", public_health=False)))
    try:
        with Client(server.address) as client, pytest.raises(Unauthenticated):
            client.health()
        with Client(server.address, token=TOKEN) as client:
            assert client.health() == "SERVING"
        with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.close()


# -- TLS --------------------------------------------------------------------------------------------

def test_tls_serves_a_client_that_trusts_the_cert_only(tmp_path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                    "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    server, _ = make_door(FrontDoorConfig(tls=TLSConfig(cert_file=str(cert), key_file=str(key))))
    try:
        with Client(server.address, root_certificates=cert) as client:
            assert client.generate("hi").text == "t1t2t3"
        with Client(server.address, max_retries=0, timeout=5) as plain, pytest.raises(Unavailable):
            plain.generate("hi")
    finally:
        server.close()


# -- status codes and retries -------------------------------------------------------------------

def test_unavailable_before_the_first_token_is_retried(door) -> None:
    server, backend = door
    with Client(server.address, max_retries=3) as client:
        backend.fail = [NoWorker("no live decode worker"), NoWorker("no live decode worker")]
        assert client.generate("hi").token_ids == [1, 2, 3]
        backend.fail = [NoWorker("no live decode worker")]
        assert [c.text for c in client.stream("hi")] == ["t1", "t2", "t3"]
    assert len(backend.calls) == 5
    with Client(server.address, max_retries=0) as client:
        backend.fail = [NoWorker("no live decode worker")]
        with pytest.raises(Unavailable) as info:
            client.generate("hi")
    assert info.value.retry_after_s == 1.0 and "no live decode worker" in info.value.message


def test_a_bug_is_internal_with_a_log_id_and_no_internal_text(door) -> None:
    server, backend = door
    backend.fail = [RuntimeError("/opt/brigade/secret/path.py: ray::DecodeActor internals")]
    with Client(server.address, max_retries=0) as client, pytest.raises(BrigadeError) as info:
        client.generate("hi")
    assert info.value.code == grpc.StatusCode.INTERNAL and "logged it under id" in info.value.message
    assert "/opt/brigade" not in info.value.message and "ray::" not in info.value.message


def test_overloaded_is_resource_exhausted_and_not_retried(door) -> None:
    server, backend = door
    backend.fail = [Overloaded("overloaded: 9 requests waiting")]
    with Client(server.address, max_retries=3) as client, pytest.raises(ResourceExhausted) as info:
        client.generate("hi")
    assert info.value.retry_after_s == 1.0 and len(backend.calls) == 1


def test_unavailable_after_the_first_token_is_not_retried(door) -> None:
    server, backend = door
    backend.fail_mid_stream = NoWorker("a worker died mid-request")
    got = []
    with Client(server.address, max_retries=3) as client, pytest.raises(Unavailable, match="died mid-request"):
        for chunk in client.stream("hi"):
            got.append(chunk.text)
    assert got == ["t1"] and len(backend.calls) == 1
    with Client(server.address, max_retries=3) as client, pytest.raises(Unavailable) as info:
        client.generate("hi")  # unary: the server says tokens existed, so the SDK does not rerun it
    assert info.value.started and info.value.retry_after_s is None and len(backend.calls) == 2


def test_the_async_client_retries_and_raises_typed_errors(door) -> None:
    import asyncio

    from brigade_client import AsyncClient

    server, backend = door

    async def main():
        async with AsyncClient(server.address, max_retries=2) as client:
            backend.fail = [NoWorker("no live prefill worker")]
            assert [c.text async for c in client.stream("hi")] == ["t1", "t2", "t3"]
            backend.fail = [NoWorker("no live prefill worker")]
            assert (await client.generate("hi")).token_ids == [1, 2, 3]
            with pytest.raises(InvalidArgument) as info:
                await client.generate("hi", min_p=2.0)
            assert info.value.field == "min_p" and info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            backend.fail = [Overloaded("overloaded")]
            with pytest.raises(ResourceExhausted):
                [c async for c in client.stream("hi")]
            assert await client.tokenize(messages=[{"role": "user", "content": "x"}]) == [8]
            assert await client.detokenize([4, 5]) == "4,5"
            assert [m.id for m in await client.models()] == ["stand-in"]

    asyncio.run(main())
    assert len(backend.calls) == 5  # 2 + 2 with a retry each, min_p refused at the door, 1 overloaded


def test_retry_delay_is_jittered_bounded_and_only_for_unavailable() -> None:
    from brigade_client import BrigadeError
    from brigade_client._calls import BACKOFF_BASE_S, Deadline, retry_delay

    unavailable = BrigadeError(grpc.StatusCode.UNAVAILABLE, "no worker")
    hinted = BrigadeError(grpc.StatusCode.UNAVAILABLE, "no worker", retry_after_s=0.5)
    delays = [retry_delay(unavailable, 2, 3, Deadline(None)) for _ in range(200)]
    assert all(0 <= d <= BACKOFF_BASE_S * 4 for d in delays) and len(set(delays)) > 100  # jittered
    assert retry_delay(hinted, 0, 3, Deadline(None)) >= 0.5  # never sooner than the server asks
    assert retry_delay(unavailable, 3, 3, Deadline(None)) is None  # out of retries
    assert retry_delay(hinted, 0, 3, Deadline(0.1)) is None  # the wait would outlive the call's timeout
    for code in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert retry_delay(BrigadeError(code, "x"), 0, 3, Deadline(None)) is None


def test_another_model_and_bad_fields_are_refused(door) -> None:
    server, backend = door
    with Client(server.address) as client:
        with pytest.raises(NotFound, match="model") as info:
            client.generate("hi", model="gpt-9")
        assert info.value.field == "model"
        with pytest.raises(InvalidArgument) as info:
            client.generate("hi", top_p=0.0)
        assert info.value.field == "top_p"
    with grpc.insecure_channel(server.address) as channel, pytest.raises(grpc.RpcError) as raw:
        channel.unary_unary("/brigade.v1.Brigade/GenerateUnary")(b"", timeout=10)  # no prompt at all
    assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raw.value.details() == "prompt: set one of text, token_ids or chat"
    assert backend.calls == []


def test_unset_sampling_fields_keep_the_engine_defaults(door) -> None:
    server, backend = door
    with Client(server.address) as client:
        client.generate("hi")
        client.generate("hi", temperature=0.0, top_k=0, max_tokens=5, stop="x")
    default, explicit = (r.params for r in backend.calls)
    assert (default.temperature, default.top_k, default.max_tokens) == (1.0, -1, 16)
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens, explicit.stop) == (0.0, 0, 5, ("x",))


def test_usage_carries_the_speculative_counters_when_speculation_ran(door, capsys) -> None:
    server, backend = door
    with Client(server.address) as client:
        assert client.generate("hi").usage.speculative is None  # it did not run: no counters, as over HTTP
        backend.spec = (8, 6, 3)
        want = SpeculativeUsage(draft_tokens=8, accepted_tokens=6, verify_steps=3, acceptance_rate=0.75,
                                accepted_per_step=2.0)
        assert client.generate("hi").usage.speculative == want
        assert list(client.stream("hi"))[-1].usage.speculative == want
    assert client_cli.main(["generate", "--target", server.address, "--usage", "hi"]) == 0
    assert json.loads(capsys.readouterr().err)["usage"]["speculative"]["acceptance_rate"] == 0.75


# -- health --------------------------------------------------------------------------------------

def test_health_follows_the_backend_and_is_not_serving_before_attach() -> None:

    server = GrpcServer("127.0.0.1", 0, FrontDoorConfig(), FrontDoorMetrics(), health_interval_s=0.05)
    try:
        with Client(server.address, max_retries=0) as client:
            assert client.health() == "NOT_SERVING"
            with pytest.raises(Unavailable, match="starting"):
                client.generate("hi")
            backend = StandIn()
            backend.healthy = False
            server.attach(backend)
            assert client.health() == "NOT_SERVING"  # no live worker of a needed role
            backend.healthy = True
            wait_for(lambda: client.health() == "SERVING", 10.0, "health SERVING", interval_s=0.05)
    finally:
        server.close()


# -- the CLI and the package ------------------------------------------------------------------------

def test_cli_streams_a_completion_to_stdout(door, capsys) -> None:
    server, _ = door
    assert client_cli.main(["generate", "--target", server.address, "--max-tokens", "3", "hi"]) == 0
    assert capsys.readouterr().out == "t1t2t3\n"
    assert client_cli.main(["health", "--target", server.address]) == 0
    with pytest.raises(SystemExit):
        client_cli.main(["generate", "--help"])
    assert "brigade-client generate --target 127.0.0.1:50051" in capsys.readouterr().out


def test_committed_stubs_match_the_proto() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "client" / "tools" / "gen_proto.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_the_client_package_installs_and_imports_alone(tmp_path) -> None:
    """`pip install ./client` with no extra step: the stubs ship in the package."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(ROOT / "client")], check=True, capture_output=True)
    code = ("import brigade_client, brigade_client.v1.brigade_pb2_grpc as g; "
            "print(brigade_client.__file__); print(g.BrigadeStub.__name__)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(target)}, cwd=tmp_path)
    assert proc.stdout.splitlines() == [str(target / "brigade_client" / "__init__.py"), "BrigadeStub"]


def test_a_chat_without_max_tokens_may_run_to_the_end_of_the_context(door) -> None:
    """As the HTTP door's chat (and OpenAI's): an unset max_tokens on a chat prompt is the room
    the context leaves; a text or token-id prompt keeps the engine's default, and a set one stays."""
    server, backend = door
    with Client(server.address) as client:
        client.chat([{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}])
        client.chat([{"role": "user", "content": "hi"}], max_tokens=5)
        client.generate("hi")
    assert [r.params.max_tokens for r in backend.calls] == [backend.max_model_len - 2, 5, 16]
