"""The OpenAI-compatible HTTP door over a stand-in backend (no Ray, no model): request
parsing, response shapes (completion and chat, whole and streamed, logprobs), auth and the
tenant's cache salt, /metrics, TLS, message limits and the shared invalid-request table.

The official `openai` client is the caller wherever it can express the request; the
stand-in validates with the engine's own check_request, so the table's errors are real.
"""
from __future__ import annotations

import asyncio
import json
import socket
import ssl
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from invalid_cases import HTTP_CASES, Limits
from support import wait_for

from engine.messages import Chunk
from engine.outputs import Usage
from engine.request_checks import check_request, output_room
from engine.sampling import InvalidRequest, TokenLogprobs
from router.auth import Authenticator
from router.config import FrontDoorConfig
from router.errors import NoWorker, Overloaded
from router.http.server import ApiServer
from router.metrics import FrontDoorMetrics

LIMITS = Limits(max_model_len=64, vocab_size=100)
ACME, ZETA = "acme-token-0123456789", "zeta-token-0123456789"


class FakeBackend:
    """Two chunks ("ab", then "c" finishing), or `endless` chunks until closed; records every
    generate() call. Validation is the engine's own check_request."""

    model_name, max_model_len, vocab_size = "fake", LIMITS.max_model_len, LIMITS.vocab_size

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.closed: list[str] = []
        self.fail: Exception | None = None
        self.stats_fail: Exception | None = None  # worker_stats() raises it
        self.endless = False

    def tokenize(self, prompt):
        return [ord(c) % LIMITS.vocab_size for c in prompt] if isinstance(prompt, str) else prompt

    def detokenize(self, token_ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in token_ids)

    def chat_token_ids(self, messages):
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("messages", "must be a non-empty list")
        self.messages = messages
        return [7] * len(messages)

    def validate(self, token_ids, params) -> None:
        check_request(token_ids, params, vocab_size=LIMITS.vocab_size, max_model_len=LIMITS.max_model_len,
                      block_size=16, num_blocks=64)

    def output_room(self, token_ids) -> int:
        return output_room(token_ids, max_model_len=LIMITS.max_model_len, block_size=16, num_blocks=64)

    async def generate(self, req):
        request_id, token_ids, params = req.request_id, req.prompt_token_ids, req.params
        self.calls.append({"id": request_id, "ids": token_ids, "params": params, "cache_salt": req.cache_salt})
        if self.fail is not None:
            raise self.fail

        def lp(token):
            if params.logprobs is None:
                return None
            return [TokenLogprobs(token, -0.25 * token, [(token, -0.25 * token), (9, -3.0)][:params.logprobs])]

        try:
            if self.endless:
                while True:
                    yield Chunk(request_id, [1], "b", logprobs=lp(1))
                    await asyncio.sleep(0.01)
            yield Chunk(request_id, [0, 1], "ab", logprobs=(lp(0) or []) + (lp(1) or []) or None)
            yield Chunk(request_id, [2], "c", True, "length", Usage(len(token_ids), 3, 2, {"device": 2}),
                        logprobs=lp(2))
        finally:
            self.closed.append(request_id)

    async def health(self):
        return True, {"waiting": 3, "running": 2}

    async def worker_stats(self):
        if self.stats_fail is not None:
            raise self.stats_fail
        return {"mixed-0": {"step_times": {"decode": {"1": {"steps": 5, "wall_s": 0.1, "cpu_s": 0.09}}}}}


def start(frontdoor: FrontDoorConfig = FrontDoorConfig(), auth: Authenticator | None = None):
    server = ApiServer("127.0.0.1", 0, frontdoor, metrics=FrontDoorMetrics(), auth=auth)
    server.backend = FakeBackend()
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


@pytest.fixture
def server() -> Iterator[ApiServer]:
    s = start()
    yield s
    s.shutdown()
    s.server_close()


@pytest.fixture
def authed() -> Iterator[ApiServer]:
    s = start(auth=Authenticator({ACME: "acme", ZETA: "zeta"}))
    yield s
    s.shutdown()
    s.server_close()


def client(server: ApiServer, key: str = "unused", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30, **kwargs)


def post(url: str, body: dict | bytes, token: str | None = None, ctx=None) -> tuple[int, dict, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=30,
                                    context=ctx) as resp:
            return resp.status, json.loads(resp.read()), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read()), dict(exc.headers)


def get(url: str, token: str | None = None) -> tuple[int, bytes, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
            return resp.status, resp.read(), dict(resp.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), dict(exc.headers)


def metric(server: ApiServer, name: str, **labels) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    assert server.wait_idle(10)  # a handler records its answer just after the client has it
    text = server.metrics.exposition().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


# -- responses ----------------------------------------------------------------------------------


def test_completion_whole_and_streamed_with_logprobs(server: ApiServer) -> None:
    api = client(server)
    done = api.completions.create(model="fake", prompt="hi", max_tokens=3, logprobs=2, user="ignored")
    assert done.object == "text_completion" and done.model == "fake"
    choice = done.choices[0]
    assert (choice.text, choice.finish_reason) == ("abc", "length")
    assert choice.logprobs.tokens == ["a", "b", "c"]
    assert choice.logprobs.token_logprobs == [0.0, -0.25, -0.5]
    assert choice.logprobs.top_logprobs[1] == {"b": -0.25, "j": -3.0}
    assert choice.logprobs.text_offset == [0, 1, 2]
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.total_tokens) == (2, 3, 5)
    assert done.usage.prompt_tokens_details.cached_tokens == 2
    call = server.backend.calls[-1]
    assert call["params"].logprobs == 2 and call["params"].max_tokens == 3

    events = list(api.completions.create(model="fake", prompt=[5, 6], max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}))
    assert [e.choices[0].text for e in events[:-1]] == ["ab", "c"]
    assert [e.choices[0].finish_reason for e in events[:-1]] == [None, "length"]
    assert events[-1].choices == [] and events[-1].usage.prompt_tokens_details.cached_tokens == 2
    assert all(e.choices[0].logprobs is None for e in events[:-1])  # not asked for


def test_a_chat_without_max_tokens_may_run_to_the_end_of_the_context(server: ApiServer) -> None:
    """OpenAI's and vLLM's chat default: the room the context leaves (within the KV pool), not a
    completion's legacy 16 tokens; either spelling of the field, when sent, wins."""
    api = client(server)
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]
    api.chat.completions.create(model="fake", messages=messages)
    api.chat.completions.create(model="fake", messages=messages, max_tokens=7)
    api.chat.completions.create(model="fake", messages=messages, max_completion_tokens=9)
    api.completions.create(model="fake", prompt="hi")
    room = min(LIMITS.max_model_len, 16 * 64) - 2
    assert [c["params"].max_tokens for c in server.backend.calls] == [room, 7, 9, 16]


def test_chat_whole_and_streamed_with_logprobs(server: ApiServer) -> None:
    api = client(server)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    done = api.chat.completions.create(model="fake", messages=messages, max_completion_tokens=5, seed=3,
                                       stop=["zz"], top_p=0.9, temperature=0.5, logprobs=True, top_logprobs=1)
    assert done.object == "chat.completion" and done.id.startswith("chatcmpl-")
    choice = done.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == ("assistant", "abc", "length")
    assert [(e.token, e.logprob, e.bytes) for e in choice.logprobs.content] == [
        ("a", 0.0, [97]), ("b", -0.25, [98]), ("c", -0.5, [99])]
    assert [[t.token for t in e.top_logprobs] for e in choice.logprobs.content] == [["a"], ["b"], ["c"]]
    assert done.usage.prompt_tokens == 2 and done.usage.prompt_tokens_details.cached_tokens == 2
    p = server.backend.calls[-1]["params"]
    assert (p.max_tokens, p.seed, p.stop, p.top_p, p.temperature, p.logprobs) == (5, 3, ("zz",), 0.9, 0.5, 1)

    events = list(api.chat.completions.create(model="fake", messages=messages, stream=True,
                                              stream_options={"include_usage": True}))
    assert events[0].object == "chat.completion.chunk"
    assert (events[0].choices[0].delta.role, events[0].choices[0].delta.content) == ("assistant", "")
    assert "".join(e.choices[0].delta.content for e in events[1:-1]) == "abc"
    assert events[-2].choices[0].finish_reason == "length" and events[1].choices[0].finish_reason is None
    assert events[-1].choices == [] and events[-1].usage.completion_tokens == 3
    assert server.backend.calls[-1]["params"].logprobs is None

    # what clients send by default is accepted: neutral penalties, plain-text format, content as text parts
    api.chat.completions.create(model="fake", frequency_penalty=0, presence_penalty=0.0, tools=[],
                                response_format={"type": "text"},
                                messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                       {"type": "text", "text": "b"}]}])
    assert server.backend.messages == [{"role": "user", "content": "ab"}]


def test_models_and_unknown_model(server: ApiServer) -> None:
    api = client(server)
    assert [m.id for m in api.models.list()] == ["fake"]
    assert api.models.retrieve("fake").id == "fake"
    with pytest.raises(openai.NotFoundError) as info:
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["param"] == "model" and "gpt-4" in info.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("gpt-4")
    assert not server.backend.calls


def test_openapi_document_describes_the_served_model(server: ApiServer) -> None:
    status, data, headers = get(f"{server.url}/openapi.json")
    doc = json.loads(data)
    assert status == 200 and headers["Content-Type"] == "application/json" and doc["openapi"].startswith("3.")
    completion = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["model"]["anyOf"][0] == {"const": "fake", "type": "string"}  # the one model it serves
    assert next(s["maximum"] for s in completion["top_k"]["anyOf"] if "maximum" in s) == LIMITS.vocab_size
    assert "security" not in doc


def test_integral_floats_are_integers_as_json_schema_has_them(server: ApiServer) -> None:
    status, _, _ = post(f"{server.url}/v1/completions", {"prompt": [1.0, 2.0], "max_tokens": 3.0, "seed": 0.0,
                                                         "top_k": 5.0, "stop_token_ids": [4.0]})
    assert status == 200
    params = server.backend.calls[-1]["params"]
    assert server.backend.calls[-1]["ids"] == [1, 2] and (params.max_tokens, params.seed, params.top_k) == (3, 0, 5)
    status, err, _ = post(f"{server.url}/v1/completions", {"prompt": "hi", "max_tokens": 2.5})
    assert status == 400 and err["error"]["param"] == "max_tokens"


# -- refusals -----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c.name for c in HTTP_CASES])
def test_invalid_request_table(server: ApiServer, case) -> None:
    status, err, _ = post(f"{server.url}/v1/completions", case.request(LIMITS))
    assert status == 400, err
    assert err["error"]["param"] == case.field and err["error"]["type"] == "invalid_request_error"
    assert case.field in err["error"]["message"]
    assert not server.backend.calls  # refused before any work was queued
    status, done, _ = post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})
    assert status == 200 and done["choices"][0]["text"] == "abc"


@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,  # RecursionError in the parser
    b'{"prompt": "hi", "a":' + b'{"b":' * 50_000 + b"1" + b"}" * 50_001,
    b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}",  # past Python's int-parsing limit
    b'{"prompt": "hi", "temperature": 1e999999}',  # inf
], ids=["nested list", "nested object", "huge int", "huge float"])
def test_hostile_json_is_400_not_500(server: ApiServer, raw: bytes) -> None:
    status, err, _ = post(f"{server.url}/v1/completions", raw)
    assert status == 400, err
    assert len(err["error"]["message"]) <= 200
    assert not server.backend.calls
    assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


CHAT_INVALID = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": "yes"}, "logprobs"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 1000}, "max_completion_tokens"),
    ({"n": 2}, "n"),
    ({"temperature": "hot"}, "temperature"),
    ({"stream": "yes"}, "stream"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
]


def test_invalid_chat_requests_name_the_field(server: ApiServer) -> None:
    api = client(server)
    for extra, field in CHAT_INVALID:
        with pytest.raises(openai.BadRequestError) as info:  # extra_body: sent as given, past the client's types
            api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}], extra_body=extra)
        assert info.value.body["param"] == field, (extra, info.value.body)
    assert not server.backend.calls
    assert api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}]).choices
    assert metric(server, "brigade_requests_total", door="http", outcome="invalid") == len(CHAT_INVALID)
    assert metric(server, "brigade_requests_total", door="http", outcome="ok") == 1


def test_bad_bodies_and_the_size_limit() -> None:
    server = start(FrontDoorConfig(max_message_bytes=1024))
    try:
        url = f"{server.url}/v1/completions"
        status, err, _ = post(url, {"prompt": "x" * 2000})
        assert status == 413 and "max_message_bytes" in err["error"]["message"]
        assert err["error"]["type"] == "invalid_request_error"
        assert post(url, b"{not json")[0] == 400
        status, err, _ = post(url, b"[1, 2]")
        assert status == 400 and "JSON object" in err["error"]["message"]
        assert post(f"{server.url}/v1/nope", {"prompt": "x"})[0] == 404
        assert not server.backend.calls
        assert post(url, {"prompt": "x"})[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_a_body_that_stalls_or_ends_early(server: ApiServer) -> None:
    server.io_timeout_s = 0.5
    with raw_post(server, b'{"prompt": ', length=40) as sock:  # promises 40 bytes, sends 11 and waits
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 408") and b"did not arrive" in reply
    with raw_post(server, b'{"prompt": ', length=40) as sock:
        sock.shutdown(socket.SHUT_WR)  # sends 11 and ends
        reply = sock.makefile("rb").read()
    assert reply.startswith(b"HTTP/1.0 400") and b"ended after 11 of 40 bytes" in reply
    assert not server.backend.calls


def test_router_refusals_surface_as_openai_exceptions(server: ApiServer) -> None:
    api = client(server)
    server.backend.fail = Overloaded("overloaded: 9 requests waiting; retry later")
    with pytest.raises(openai.RateLimitError) as info:
        api.completions.create(model="fake", prompt="hi", stream=True)
    assert info.value.response.headers["Retry-After"] == "1"
    server.backend.fail = NoWorker("no live decode worker")
    with pytest.raises(openai.InternalServerError) as info:
        api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 503 and "no live decode worker" in info.value.message
    assert metric(server, "brigade_requests_total", door="http", outcome="overloaded") == 1
    assert metric(server, "brigade_requests_total", door="http", outcome="unavailable") == 1


def test_a_bug_answers_500_with_a_log_id_and_no_internal_text(server: ApiServer) -> None:
    from engine.engine_loop import RequestFailed

    server.backend.fail = RuntimeError("/opt/brigade/secret/path.py: ray::DecodeActor internals")
    status, err, _ = post(f"{server.url}/v1/completions", {"prompt": "hi"})
    assert status == 500 and "logged it under id" in err["error"]["message"]
    assert "/opt/brigade" not in err["error"]["message"] and "ray::" not in err["error"]["message"]
    server.backend.fail = RequestFailed("the request failed in the engine (sampling); log id 0123456789ab")
    status, err, _ = post(f"{server.url}/v1/completions", {"prompt": "hi"})
    assert status == 500 and err["error"]["message"].endswith("log id 0123456789ab")  # its own, safe message
    server.backend.fail = None
    assert post(f"{server.url}/v1/completions", {"prompt": "ok", "max_tokens": 3})[0] == 200


def raw_post(server: ApiServer, body: bytes, length: int | None = None) -> socket.socket:
    sock = socket.create_connection(server.server_address[:2])
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body) if length is None else length}\r\n\r\n".encode() + body)
    return sock


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_closes_the_backend_stream(server: ApiServer, stream: bool) -> None:
    server.backend.endless = True
    with raw_post(server, json.dumps({"prompt": "hi", "stream": stream, "max_tokens": 60}).encode()) as sock:
        if stream:
            got = b""
            while b"data: {" not in got:
                got += sock.recv(4096)
        else:  # nothing comes back before the end: wait until the request is being generated
            wait_for(lambda: server.backend.calls, 10.0, "the request reached the backend", interval_s=0.02)
    wait_for(lambda: server.backend.closed, 10.0, "the backend's stream closed", interval_s=0.02)
    assert server.backend.closed == [server.backend.calls[0]["id"]]
    wait_for(lambda: not server.in_flight, 10.0, "no request in flight", interval_s=0.02)
    assert metric(server, "brigade_requests_total", door="http", outcome="cancelled") == 1
    assert metric(server, "brigade_requests_in_flight", door="http") == 0


# -- auth, metrics, TLS -------------------------------------------------------------------------


def test_auth_needs_a_known_bearer_token_and_salts_by_tenant(authed: ApiServer) -> None:
    url = f"{authed.url}/v1/completions"
    for token in (None, "nope", ACME[:-1]):
        status, err, headers = post(url, {"prompt": "hi"}, token)
        assert status == 401 and headers["WWW-Authenticate"].startswith("Bearer")
        assert err["error"]["type"] == "authentication_error" and err["error"]["code"] == "invalid_api_key"
    assert get(f"{authed.url}/v1/models")[0] == 401
    assert get(f"{authed.url}/openapi.json")[0] == 401
    assert json.loads(get(f"{authed.url}/openapi.json", ACME)[1])["security"] == [{"bearer": []}]
    assert get(f"{authed.url}/metrics")[0] == 401
    assert get(f"{authed.url}/health")[0] == 200  # public_health
    assert not authed.backend.calls

    with pytest.raises(openai.AuthenticationError):
        client(authed, "wrong-token-0123456789").completions.create(model="fake", prompt="hi")
    acme, zeta = client(authed, ACME), client(authed, ZETA)
    assert acme.completions.create(model="fake", prompt="hi").choices[0].text == "abc"
    zeta.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}])
    acme.completions.create(model="fake", prompt="hi", extra_body={"cache_salt": "conv-7"})
    assert [c["cache_salt"] for c in authed.backend.calls] == ["acme", "zeta", "acme:conv-7"]
    assert get(f"{authed.url}/metrics", ACME)[0] == 200
    assert metric(authed, "brigade_requests_total", door="http", outcome="unauthenticated") == 4


def test_a_metrics_only_token_reads_metrics_and_nothing_else() -> None:
    scraper = "scraper-token-0123456789"
    server = start(auth=Authenticator({ACME: "acme"}, metrics_tokens=(scraper,)))
    try:
        assert get(f"{server.url}/metrics", scraper)[0] == 200
        assert get(f"{server.url}/metrics", ACME)[0] == 200
        assert get(f"{server.url}/metrics")[0] == 401
        assert get(f"{server.url}/v1/models", scraper)[0] == 401
        assert post(f"{server.url}/v1/completions", {"prompt": "hi"}, scraper)[0] == 401
        assert not server.backend.calls
    finally:
        server.shutdown()
        server.server_close()


def test_public_health_is_trimmed_and_cached(authed: ApiServer) -> None:
    calls = []
    real = authed.backend.health

    async def counted():
        calls.append(1)
        return await real()
    authed.backend.health = counted
    authed.health_cache.ttl_s = 60.0  # one answer for the whole test
    status, body, _ = get(f"{authed.url}/health")
    assert status == 200 and json.loads(body) == {"status": "ok"}  # no workers, queue or index for strangers
    status, body, _ = get(f"{authed.url}/health", ACME)
    assert status == 200 and json.loads(body)["waiting"] == 3  # the details for a token holder
    with ThreadPoolExecutor(8) as pool:
        assert set(pool.map(lambda _: get(f"{authed.url}/health")[0], range(64))) == {200}
    assert len(calls) == 1  # 66 probes, one question to the backend


def test_private_health_needs_the_token() -> None:
    cfg = FrontDoorConfig(auth={"token_env": "X", "public_health": False})
    server = start(cfg, Authenticator({ACME: "acme"}))
    try:
        assert get(f"{server.url}/health")[0] == 401
        assert get(f"{server.url}/health", ACME)[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_metrics_count_answers_and_read_the_router_queue(server: ApiServer) -> None:
    api = client(server)
    api.completions.create(model="fake", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="fake", prompt="hi", temperature=-1)
    assert server.wait_idle(10)
    status, text, headers = get(f"{server.url}/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert b'brigade_requests_total{door="http",outcome="ok"} 1.0' in text
    assert b'brigade_requests_total{door="http",outcome="invalid"} 1.0' in text
    assert b"brigade_router_waiting 3.0" in text and b"brigade_router_running 2.0" in text
    assert metric(server, "brigade_cached_prompt_tokens_total", tier="device") == 2
    assert metric(server, "brigade_generated_tokens_total") == 3
    assert metric(server, "brigade_time_to_first_token_seconds_count", door="http") == 1
    # the workers' engine steps, read at scrape time; a scrape whose worker call fails keeps them
    assert b'brigade_engine_steps_total{batch="1",kind="decode",worker="mixed-0"} 5.0' in text
    server.backend.stats_fail = TimeoutError()
    status, text, _ = get(f"{server.url}/metrics")
    assert status == 200 and b'brigade_engine_step_cpu_seconds_total{batch="1",kind="decode",worker="mixed-0"} 0.09' \
        in text and b'brigade_requests_total{door="http",outcome="ok"} 1.0' in text


def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    server = start(FrontDoorConfig(tls={"cert_file": str(cert), "key_file": str(key)}))
    try:
        assert server.url.startswith("https://127.0.0.1:")
        with httpx.Client(verify=ssl.create_default_context(cafile=str(cert))) as http:
            api = client(server, http_client=http)
            assert api.completions.create(model="fake", prompt="hi").choices[0].text == "abc"
            events = list(api.chat.completions.create(model="fake", messages=[{"role": "user", "content": "x"}],
                                                      stream=True))
            assert "".join(e.choices[0].delta.content or "" for e in events) == "abc"
        with pytest.raises(urllib.error.URLError) as info:  # clients refuse a certificate they do not trust
            post(f"{server.url}/v1/completions", {"prompt": "x"}, ctx=ssl.create_default_context())
        assert isinstance(info.value.reason, ssl.SSLCertVerificationError)
        with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):  # plain HTTP gets no answer
            post(f"http://127.0.0.1:{server.server_address[1]}/v1/completions", {"prompt": "x"})
        assert post(f"{server.url}/v1/completions", {"prompt": "x"},
                    ctx=ssl.create_default_context(cafile=str(cert)))[0] == 200
    finally:
        server.shutdown()
        server.server_close()


def test_unreadable_certificate_fails_at_construction(tmp_path: Path) -> None:
    from router.http.server import TLSSetupError

    (tmp_path / "junk.pem").write_text("junk")
    with pytest.raises(TLSSetupError, match="frontdoor.tls: cannot load cert_file"):
        ApiServer("127.0.0.1", 0, FrontDoorConfig(tls={"cert_file": str(tmp_path / "junk.pem"),
                                                       "key_file": str(tmp_path / "junk.pem")}))
