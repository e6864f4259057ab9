"""Strings that are not text, and prompts no context can hold, through the real doors: the HTTP
door and the gRPC server in front of the cluster's own backend (ClusterBackend: its tokenizer,
its limits, its checks), whose generate answers at once instead of asking a router (no Ray).

A lone UTF-16 surrogate in any field is a 400 / INVALID_ARGUMENT naming the field's path, and
nothing reaches generate; a 4 MB prompt is refused naming `prompt` without being tokenized;
valid non-ASCII text goes through.
"""
from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from brigade_client.errors import FIELD_KEY
from brigade_client.v1 import brigade_pb2 as pb

from cluster.backend import ClusterBackend
from cluster.config import ClusterConfig
from engine.messages import Chunk
from engine.outputs import Usage
from router.config import FrontDoorConfig
from router.grpc.server import GrpcServer
from router.http.server import ApiServer
from router.metrics import FrontDoorMetrics

GOOD = "naïve café, 日本語, 😀, עברית"
HUGE = 4_000_000  # characters: a body just under the 4 MiB message limit
NO_HANG_S = 60.0  # a generous "nothing hangs" bound, not a timing goal


class Answering(ClusterBackend):
    """The cluster's backend, answering one token at once where it would ask the router."""

    def __init__(self) -> None:
        super().__init__(ClusterConfig())
        self.num_blocks = 256  # as if a worker had reported its KV pool
        self.calls: list = []

    async def generate(self, req):
        self.calls.append(req)
        yield Chunk(req.request_id, [5], "x", True, "length", Usage(len(req.prompt_token_ids), 1, 0))

    async def health(self):
        return True, {}

    async def worker_stats(self):
        return {}


@pytest.fixture(scope="module")
def doors() -> Iterator[tuple[str, str, Answering]]:
    backend = Answering()
    http = ApiServer("127.0.0.1", 0, FrontDoorConfig(), metrics=FrontDoorMetrics())
    http.backend = backend
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    rpc = GrpcServer("127.0.0.1", 0, FrontDoorConfig(), FrontDoorMetrics())
    rpc.attach(backend)
    try:
        yield f"http://127.0.0.1:{http.server_address[1]}", rpc.address, backend
    finally:
        http.shutdown()
        http.server_close()
        rpc.close()


def post(base: str, path: str, body: dict | bytes) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # "\ud800" goes as its escape
    return httpx.post(base + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=NO_HANG_S)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
HTTP_CASES = [  # (route, body, the field the 400 names)
    ("/v1/completions", {"prompt": "a \ud800 b"}, "prompt"),
    ("/v1/completions", {"prompt": ["\udc80"]}, "prompt[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": "\udfff"}, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": ["ok", "x\ud800"]}, "stop[1]"),
    ("/v1/completions", {"prompt": [5, 6, 7], "cache_salt": "\ud800"}, "cache_salt"),
    ("/v1/completions", {"prompt": "hi", "user": "\udc80"}, "user"),
    ("/v1/completions", {"prompt": "hi", "model": "\udc80"}, "model"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\udc80"}]}, "messages[0].content"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "us\ud800", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "fine"}, {"type": "text", "text": "\ud800"}]}]}, "messages[0].content[1].text"),
    ("/v1/chat/completions", {**CHAT, "documents": [{"title": "t", "text": "\udc80"}]}, "documents[0].text"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"flag": "\ud800"}}, "chat_template_kwargs.flag"),
    ("/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"\ud800": 1}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {**CHAT, "stop": ["\udc80"]}, "stop[0]"),
]


@pytest.mark.parametrize(("route", "body", "field"), HTTP_CASES, ids=[c[2] for c in HTTP_CASES])
def test_http_refuses_a_lone_surrogate_naming_the_field(doors, route: str, body: dict, field: str) -> None:
    base, _, backend = doors
    before = len(backend.calls)
    r = post(base, route, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert "surrogate" in error["message"]
    assert len(backend.calls) == before


def test_http_refuses_raw_surrogate_bytes_too(doors) -> None:
    base, _, _ = doors
    r = post(base, "/v1/completions", b'{"prompt": "hi", "cache_salt": "\xed\xa0\x80"}')
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_http_passes_valid_text_through_the_real_tokenizer(doors) -> None:
    base, _, backend = doors
    r = post(base, "/v1/completions", {"prompt": GOOD, "max_tokens": 1, "cache_salt": GOOD, "stop": [GOOD]})
    assert r.status_code == 200, r.text
    assert backend.calls[-1].prompt_token_ids == backend.tokenizer.encode(GOOD)
    r = post(base, "/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": GOOD}]}], "chat_template_kwargs": {"enable_thinking": False, GOOD: GOOD}})
    assert r.status_code == 200, r.text


def test_http_refuses_a_4mb_prompt_before_tokenizing_it(doors) -> None:
    base, _, backend = doors
    start = time.monotonic()
    r = post(base, "/v1/completions", {"prompt": "x" * HUGE, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt"
    assert f"more than the {backend.tokenizer.max_text_chars:,}" in error["message"]
    assert time.monotonic() - start < NO_HANG_S


# -- gRPC ---------------------------------------------------------------------------------------

MARK = "@@MARK@@"
BAD = b"a\xed\xa0\x80b\xed\xb2\x80"  # two lone surrogates as UTF-8 would spell them: 8 bytes, as MARK


def marked(method: str, place: str) -> bytes:
    """The request `method` takes with MARK at `place`, then made bad UTF-8 in place."""
    if method == "Tokenize":
        msg = (pb.TokenizeRequest(text=MARK) if place == "text" else
               pb.TokenizeRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=MARK)])))
    else:
        chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi"),
                                         pb.ChatMessage(role="user", content="hi")])
        sampling = pb.SamplingParams(max_tokens=1, stop=["one", "two"])
        fields = {"request_id": "r-1", "cache_salt": "salt", "session_id": "s"}
        if place in fields or place == "model":
            fields[place] = MARK
        elif place == "sampling.stop[1]":
            sampling.stop[1] = MARK
        elif place.startswith("chat.messages[1]."):
            setattr(chat.messages[1], place.rsplit(".", 1)[1], MARK)
        prompt = {"text": MARK} if place == "text" else {"chat": chat}
        msg = pb.GenerateRequest(**fields, **prompt, sampling=sampling)
    return msg.SerializeToString().replace(MARK.encode(), BAD)


GRPC_CASES = [("GenerateUnary", p) for p in ("text", "cache_salt", "request_id", "model", "session_id",
                                             "sampling.stop[1]", "chat.messages[1].content", "chat.messages[1].role")]
GRPC_CASES += [("Generate", "cache_salt"), ("Generate", "chat.messages[1].content"), ("Tokenize", "text"),
               ("Tokenize", "chat.messages[0].content")]


def call(target: str, method: str, data: bytes):
    with grpc.insecure_channel(target) as channel:
        stub = (channel.unary_stream if method == "Generate" else channel.unary_unary)(f"/brigade.v1.Brigade/{method}")
        out = stub(data, timeout=NO_HANG_S)
        return list(out) if method == "Generate" else out


@pytest.mark.parametrize(("method", "place"), GRPC_CASES, ids=[f"{m}-{p}" for m, p in GRPC_CASES])
def test_grpc_refuses_bad_utf8_naming_the_field(doors, method: str, place: str) -> None:
    _, target, backend = doors
    before = len(backend.calls)
    with pytest.raises(grpc.RpcError) as err:
        call(target, method, marked(method, place))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert dict(err.value.trailing_metadata())[FIELD_KEY] == place
    assert "UTF-8" in err.value.details()
    assert len(backend.calls) == before


def test_grpc_passes_valid_text_and_refuses_a_4mb_prompt(doors) -> None:
    _, target, backend = doors
    got = pb.TokenizeResponse.FromString(call(target, "Tokenize", pb.TokenizeRequest(text=GOOD).SerializeToString()))
    assert list(got.token_ids) == backend.tokenizer.encode(GOOD)
    ok = call(target, "GenerateUnary", pb.GenerateRequest(text=GOOD, cache_salt=GOOD).SerializeToString())
    assert pb.GenerateResponse.FromString(ok).text == "x"
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        call(target, "GenerateUnary", pb.GenerateRequest(text="x" * HUGE).SerializeToString())
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(err.value.trailing_metadata())[FIELD_KEY] == "prompt"
    assert "the model's context can hold" in err.value.details()
    assert time.monotonic() - start < NO_HANG_S
