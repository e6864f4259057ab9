"""Chaos: strings no UTF-8 encoder accepts, sent to a real `brigade serve --policy round_robin`
(1 prefill + 1 decode, `tiny` preset). Load-based routing sends a request straight to a worker
without asking the prefix index first, so nothing between the door and the engine would stop a
bad string. Through the HTTP door (JSON's `\\ud800` escapes decode to lone surrogates) and the
gRPC door (invalid UTF-8 bytes in a string field) every such request is answered 400 /
INVALID_ARGUMENT naming its field; afterwards every worker is alive, none was replaced (the
same Ray actor ids), and plain requests through both doors still answer. Figures
(`hostile_strings.*`): the fraction of such requests refused with the right code and field
(target 1.0) and the workers that died or were replaced (target 0)."""
from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import pytest
import ray
from brigade_client import Client
from brigade_client.v1 import brigade_pb2 as pb
from serve_process import Served, brigade_serve, ray_driver

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT = list(range(1, 101))  # 100 tokens: fills whole KV blocks, so the salt is hashed
WORKERS = ("prefill-0", "decode-0")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("hostile_strings")
    flags = ["--policy", "round_robin", "--http-port", "0", "--grpc-port", "0", "--num-blocks", "256"]
    with brigade_serve(flags, tmp / "serve.log") as served:
        with ray_driver(served):
            yield served


def workers() -> dict[str, str]:
    """Each worker's Ray actor id, after checking that its engine says it is alive."""
    ids = {}
    for name in WORKERS:
        actor = ray.get_actor(name)
        assert ray.get(actor.health.remote(), timeout=60).alive, f"{name}'s engine is not alive"
        ids[name] = actor._actor_id.hex()
    return ids


def post(served: Served, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, exactly what a hostile client would send
    return httpx.post(served.http_base + path, content=json.dumps(body), timeout=60,
                      headers={"content-type": "application/json"})


HTTP_CASES = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "cache_salt": "\ud800"}, "cache_salt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "cache_salt": "\ud800", "stream": True}, "cache_salt"),
    ("/v1/completions", {"prompt": "hello \udc80 there", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "stop": ["ok", "\udfff"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \udc80"}], "max_tokens": 4},
     "messages"),
]


def test_surrogates_through_both_doors_are_refused_and_no_worker_dies(served: Served, chaos_figure):
    before = workers()
    answers = []  # (what was sent, refused with the right code naming the field)

    for path, body, field in HTTP_CASES:
        for _ in range(3):  # round robin: each worker gets its turn
            resp = post(served, path, body)
            answers.append(((path, body, resp.status_code, resp.text[:300]),
                            resp.status_code == 400 and field in resp.json()["error"]["message"]))

    # protobuf's own encoder refuses a surrogate, so a hostile client sends the bytes by hand:
    # field 8 (cache_salt) and field 2 (text), each the CESU-8 form of U+D800
    plain = pb.GenerateRequest(token_ids=pb.TokenIds(ids=PROMPT)).SerializeToString()
    bad = {"cache_salt": plain + b"\x42\x03\xed\xa0\x80", "text": b"\x12\x03\xed\xa0\x80"}
    with grpc.insecure_channel(served.grpc_target) as channel:
        for method in ("Generate", "GenerateUnary"):
            kind = channel.unary_stream if method == "Generate" else channel.unary_unary
            call = kind(f"/brigade.v1.Brigade/{method}", request_serializer=lambda b: b,
                        response_deserializer=lambda b: b)
            for field, raw in bad.items():
                try:
                    result = call(raw, timeout=60)
                    if method == "Generate":
                        list(result)
                    code, trailer = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code = exc.code()
                    trailer = dict(exc.trailing_metadata() or ()).get("brigade-field", "")
                answers.append(((method, field, code, trailer),
                                code == grpc.StatusCode.INVALID_ARGUMENT and trailer == field))

    after_bad = workers()
    resp = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                                            "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 4
    with Client(served.grpc_target, timeout=60) as client:
        assert len(client.generate(PROMPT, max_tokens=4, temperature=0, ignore_eos=True).token_ids) == 4
    after = workers()
    refused = sum(ok for _, ok in answers) / len(answers)
    lost = sum(before[n] != after_bad[n] or before[n] != after[n] for n in before)
    chaos_figure("hostile_strings", ratios={"refused_fraction": refused, "workers_lost": lost},
                 targets={"refused_fraction": ">= 1.0", "workers_lost": "== 0"},
                 requests=len(answers), policy="round_robin")
    assert [sent for sent, ok in answers if not ok] == []
    assert after_bad == before and after == before  # alive, and not replaced
