"""The gRPC front door end to end: the brigade-client SDK against a real grpc.aio server over
the real cluster (local Ray, router, one prefill + one decode worker, the `tiny` preset).

One cluster and one server serve the module (worker start-up dominates on two shared cores).
The backend is the real ClusterBackend; a thin subclass only counts the requests that reach
the router, so a refused request provably cost no worker anything. Door-level behaviour that
needs no model (auth, TLS, retries, message limits) is in test_grpc_door.py.
"""
from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray
from brigade_client import AsyncClient, Client, DeadlineExceeded, ResourceExhausted, Unavailable
from brigade_client.v1 import brigade_pb2 as pb
from invalid_cases import GRPC_CASES, Limits
from support import wait_for

from cluster.backend import ClusterBackend
from router.config import FrontDoorConfig
from router.grpc.server import GrpcServer
from router.metrics import FrontDoorMetrics

pytestmark = [pytest.mark.usefixtures("torch_single_thread"), pytest.mark.timeout(300)]

NUM_BLOCKS = 256
MAX_MESSAGE = 64 << 10
PROMPTS = {"text": "hello world", "ids": [5, 17, 300, 2, 99, 1000, 7]}
GREEDY = {"max_tokens": 12, "temperature": 0.0, "ignore_eos": True}


class CountingBackend(ClusterBackend):
    """The real backend; counts the requests handed to the router."""

    routed = 0

    def generate(self, req):
        self.routed += 1
        return super().generate(req)


@pytest.fixture(scope="module")
def cluster(ray_cluster):
    cl = ray_cluster(engine={"cache": {"num_blocks": NUM_BLOCKS}})
    backend = CountingBackend(cl.cfg)
    backend.attach(cl)
    return cl, backend


@pytest.fixture(scope="module")
def door(cluster):
    server = GrpcServer("127.0.0.1", 0, FrontDoorConfig(max_message_bytes=MAX_MESSAGE), FrontDoorMetrics(),
                        health_interval_s=0.2)
    server.attach(cluster[1])
    yield server
    server.close()


@pytest.fixture(scope="module")
def reference() -> dict[str, list[int]]:
    """Greedy tokens of the single-process engine for each of PROMPTS."""
    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1,
                                    cache=CacheConfig(num_blocks=NUM_BLOCKS)))
    outs = engine.generate(list(PROMPTS.values()), SamplingParams(**GREEDY))
    return dict(zip(PROMPTS, (o.token_ids for o in outs)))


def pools_whole(cl) -> bool:
    stats = cl.stats().values()
    return all(s["free_blocks"] == s["num_blocks"] and s["referenced_blocks"] == 0 and s["running"] == 0
               and s["reserved"] == s["prefilled"] == 0 and s.get("pinned_exports", 0) == 0 for s in stats)




def router_idle(cl) -> bool:
    status = ray.get(cl.router.status.remote(), timeout=10)
    return status["running"] == status["waiting"] == 0


def outcomes(door: GrpcServer, outcome: str) -> float:
    return door.state.metrics.requests.labels("grpc", outcome)._value.get()


# -- results --------------------------------------------------------------------------------------

def test_sync_stream_and_unary_give_the_engines_tokens(door, reference) -> None:
    with Client(door.address, timeout=60) as client:
        for name, prompt in PROMPTS.items():
            chunks = list(client.stream(prompt, **GREEDY))
            assert [t for c in chunks for t in c.token_ids] == reference[name]
            assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
            last = chunks[-1]
            assert last.finish_reason == "length" and last.usage.completion_tokens == len(reference[name])
            assert (last.prefill_worker, last.decode_worker) == ("prefill-0", "decode-0")
            assert 0 < last.timing.ttft_s <= last.timing.total_s and last.timing.transfer_bytes > 0

            done = client.generate(prompt, request_id=f"mine-{name}", **GREEDY)
            assert done.token_ids == reference[name] and done.request_id == f"mine-{name}"
            assert done.text == "".join(c.text for c in chunks) == client.detokenize(reference[name])
            assert done.usage.prompt_tokens == len(client.tokenize(prompt) if name == "text" else prompt)
            assert done.usage.cached_tokens == sum(done.usage.cached_by_tier.values())


def test_async_client_streams_and_unary_concurrently(door, reference) -> None:
    async def main():
        async with AsyncClient(door.address, timeout=60) as client:
            async def streamed(prompt):
                return [t async for c in client.stream(prompt, **GREEDY) for t in c.token_ids]

            async def unary(prompt):
                return (await client.generate(prompt, **GREEDY)).token_ids

            return await asyncio.gather(*(f(p) for p in PROMPTS.values() for f in (streamed, unary)))

    results = asyncio.run(main())
    assert results == [reference[name] for name in PROMPTS for _ in range(2)]


def test_chat_logprobs_models_and_health(door, cluster) -> None:
    backend = cluster[1]
    messages = [{"role": "user", "content": "What is Brigade?"}]
    with Client(door.address, timeout=60) as client:
        assert client.health() == "SERVING" and client.health("brigade.v1.Brigade") == "SERVING"
        [model] = client.models()
        assert (model.id, model.max_model_len, model.vocab_size) == ("tiny", 4096, backend.vocab_size)
        chat = client.chat(messages, **GREEDY)
        plain = client.generate(backend.chat_token_ids(messages), **GREEDY)
        assert chat.token_ids == plain.token_ids and client.tokenize(messages=messages) == backend.chat_token_ids(
            messages)
        with_lp = client.generate(PROMPTS["ids"], logprobs=3, **GREEDY)
        assert [p.token_id for p in with_lp.logprobs] == with_lp.token_ids
        assert all(len(p.top) == 3 and p.top[0][0] == p.token_id for p in with_lp.logprobs)  # greedy: the best
        assert plain.logprobs == []


def test_reflection_lists_the_services(door) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(door.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"brigade.v1.Brigade", "grpc.health.v1.Health"} <= services


# -- aborts ---------------------------------------------------------------------------------------

def test_a_client_that_leaves_mid_stream_frees_the_kv(door, cluster) -> None:
    cl, _ = cluster
    cancelled = outcomes(door, "cancelled")
    with Client(door.address, timeout=60) as client:
        stream = client.stream(PROMPTS["ids"], max_tokens=3000, temperature=0.0, ignore_eos=True)
        got = [next(stream) for _ in range(3)]
        assert not got[-1].finished
        stream.close()  # cancels the call
    wait_for(lambda: outcomes(door, "cancelled") == cancelled + 1, what="the server saw the cancellation")
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")
    assert door.in_flight == 0


def test_a_cancelled_task_while_prefilling_frees_the_kv(door, cluster) -> None:
    """The async client's task is cancelled before the first token (a 3,000-token prompt is
    still prefilling): the router aborts the prefill and the decode reservation."""
    cl, _ = cluster
    long_prompt = [random.Random(1).randrange(3, 4000) for _ in range(3000)]
    cancelled = outcomes(door, "cancelled")

    async def main():
        async with AsyncClient(door.address, timeout=120) as client:
            async def consume():
                return [c async for c in client.stream(long_prompt, max_tokens=50, temperature=0.0)]

            task = asyncio.create_task(consume())
            # admitted: now on the workers
            await asyncio.to_thread(wait_for, lambda: ray.get(cl.router.status.remote())["running"] or task.done(),
                                    30, "the request admitted", 0.01)
            assert not task.done(), "the stream ended before it could be cancelled"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    wait_for(lambda: outcomes(door, "cancelled") == cancelled + 1, what="the server saw the cancellation")
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")


def test_a_deadline_aborts_the_work(door, cluster) -> None:
    cl, _ = cluster
    deadline = outcomes(door, "deadline")
    with Client(door.address) as client, pytest.raises(DeadlineExceeded):
        client.generate(PROMPTS["ids"], max_tokens=3000, temperature=0.0, ignore_eos=True, timeout=1.5)
    wait_for(lambda: outcomes(door, "deadline") == deadline + 1, what="the server saw the deadline")
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")


# -- refusals -------------------------------------------------------------------------------------

def _proto_request(neutral: dict) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    prompt = neutral["prompt"]
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    req.sampling.SetInParent()
    for name, value in neutral.items():
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend(value)
        elif name != "prompt":
            setattr(req.sampling, name, value)
    return req


@pytest.mark.parametrize("case", GRPC_CASES, ids=[c.name for c in GRPC_CASES])
def test_invalid_requests_name_the_field_and_reach_no_worker(door, cluster, case) -> None:
    backend = cluster[1]
    limits = Limits(max_model_len=backend.max_model_len, vocab_size=backend.vocab_size)
    req = _proto_request(case.request(limits))
    routed = backend.routed
    with grpc.insecure_channel(door.address) as channel:
        call = channel.unary_unary("/brigade.v1.Brigade/GenerateUnary",
                                   response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            call(req.SerializeToString(), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith(f"{case.field}:"), info.value.details()
        assert dict(info.value.trailing_metadata())["brigade-field"] == case.field
        assert backend.routed == routed  # refused before the router
        ok = call(_proto_request({"prompt": [1, 2, 3], "max_tokens": 2}).SerializeToString(), timeout=60)
    assert len(ok.token_ids) == 2 and backend.routed == routed + 1


def test_an_oversized_message_is_resource_exhausted(door) -> None:
    with Client(door.address, timeout=30) as client:
        with pytest.raises(ResourceExhausted):
            client.generate("x" * (MAX_MESSAGE + 1), max_tokens=1)
        assert len(client.generate("x" * 100, max_tokens=1).token_ids) == 1


def test_a_thousand_mutated_requests_get_no_internal_error(door, cluster) -> None:
    """Bytes flipped, truncated, inserted into serialized requests, sent raw: every answer is a
    deliberate status (mostly INVALID_ARGUMENT), the server stays up, and nothing leaks."""
    cl, _ = cluster
    rng = random.Random(0)
    base = {
        "GenerateUnary": _proto_request({"prompt": [1, 2, 3], "max_tokens": 2, "temperature": 0.0}),
        "Generate": pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, stop=["a"])),
        "Tokenize": pb.TokenizeRequest(text="hello"),
        "Detokenize": pb.DetokenizeRequest(token_ids=[1, 2, 3]),
    }
    base["GenerateUnary"].chat.messages.add(role="user", content="hey")  # the oneof keeps chat: a third form

    def mutate(data: bytes) -> bytes:
        data = bytearray(data)
        for _ in range(rng.randint(1, 3)):
            op, at = rng.randrange(3), rng.randrange(max(1, len(data)))
            if op == 0 and data:
                data[at] ^= 1 << rng.randrange(8)
            elif op == 1:
                del data[at:]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        return bytes(data)

    cases = [(m, mutate(base[m].SerializeToString())) for m in rng.choices(list(base), k=1000)]
    with grpc.insecure_channel(door.address) as channel:
        def send(case) -> grpc.StatusCode:
            method, data = case
            kind = channel.unary_stream if method == "Generate" else channel.unary_unary
            call = kind(f"/brigade.v1.Brigade/{method}")
            try:
                result = call(data, timeout=20)
                if method == "Generate":
                    list(result)
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()

        with ThreadPoolExecutor(16) as pool:
            codes = list(pool.map(send, cases))
    bad = [(c, d) for c, (_, d) in zip(codes, cases) if c in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)]
    assert not bad, bad[:5]
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) > 100 and codes.count(grpc.StatusCode.OK) > 100
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")
    with Client(door.address) as client:
        assert client.health() == "SERVING"


INT_EXTREMES = {"int32": [-(2**31), -2, -1, 0, 1, 2**31 - 1], "int64": [-(2**63), -1, 0, 1, 2**62, 2**63 - 1]}


def _extreme_sampling():
    """pb.SamplingParams from its descriptor: each optional field unset or an extreme of its type."""
    from google.protobuf.descriptor import FieldDescriptor as F
    from hypothesis import strategies as st

    floats = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, -1.0, 0.5, 1.0, 2.0, 1e308, float("inf"), -float("inf"),
                              float("nan")])
    by_type = {F.TYPE_INT32: st.sampled_from(INT_EXTREMES["int32"]) | st.integers(-(2**31), 2**31 - 1),
               F.TYPE_INT64: st.sampled_from(INT_EXTREMES["int64"]) | st.integers(-(2**63), 2**63 - 1),
               F.TYPE_DOUBLE: floats, F.TYPE_BOOL: st.booleans()}
    fields = {}
    for f in pb.SamplingParams.DESCRIPTOR.fields:
        if f.name == "stop":
            fields[f.name] = st.lists(st.text(max_size=300), max_size=20)
        elif f.name == "stop_token_ids":
            fields[f.name] = st.lists(by_type[F.TYPE_INT64], max_size=70)
        else:
            fields[f.name] = st.none() | by_type[f.type]
    if "max_tokens" in fields:  # keep the valid requests short: a few tokens each
        fields["max_tokens"] = st.none() | st.sampled_from([-(2**63), -1, 0, 1, 2, 3, 2**31, 2**63 - 1])
    return st.fixed_dictionaries(fields).map(
        lambda d: pb.SamplingParams(**{k: v for k, v in d.items() if v is not None}))


def test_property_based_extreme_requests_get_no_internal_error_and_kill_no_worker(door, cluster) -> None:
    """hypothesis: requests built from the proto with every field at an extreme; every
    answer is OK or a deliberate status, and afterwards the same workers are alive."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    cl, _ = cluster
    actors = {wid: h._actor_id.hex() for wid, h in cl.workers.items()}
    prompts = (st.builds(lambda ids: pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids)),
                         st.lists(st.sampled_from(INT_EXTREMES["int64"]) | st.integers(0, 4200), max_size=8))
               | st.builds(lambda t: pb.GenerateRequest(text=t), st.text(max_size=40)))
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(door.address) as channel:
        call = channel.unary_unary("/brigade.v1.Brigade/GenerateUnary",
                                   response_deserializer=pb.GenerateResponse.FromString)

        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(prompts, _extreme_sampling())
        def check(req, sampling) -> None:
            req.sampling.CopyFrom(sampling)
            try:
                call(req.SerializeToString(), timeout=60)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as exc:
                codes.append(exc.code())
                assert exc.code() not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), (req, exc.details())

        check()
    assert codes.count(grpc.StatusCode.INVALID_ARGUMENT) > 10 and grpc.StatusCode.OK in codes
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")
    assert {wid: h._actor_id.hex() for wid, h in cl.workers.items()} == actors  # nobody died or was replaced
    assert all(r.alive for r in ray.get([h.health.remote() for h in cl.workers.values()]))


# -- drain (last: a second server over the same backend) ------------------------------------------

def test_drain_answers_not_serving_and_lets_streams_finish(cluster) -> None:
    cl, backend = cluster
    server = GrpcServer("127.0.0.1", 0, FrontDoorConfig(), FrontDoorMetrics(), health_interval_s=0.2)
    try:
        server.attach(backend)
        first, result = threading.Event(), {}

        def consume():
            with Client(server.address, timeout=120) as client:
                chunks = []
                for chunk in client.stream(PROMPTS["ids"], max_tokens=300, temperature=0.0, ignore_eos=True):
                    chunks.append(chunk)
                    first.set()
                result["chunks"] = chunks

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(60)
        drained = server.begin_drain(60)
        with Client(server.address, max_retries=0) as client:
            wait_for(lambda: client.health() == "NOT_SERVING", what="health NOT_SERVING")
            if not drained.done():  # the stream may have ended already on a fast machine
                with pytest.raises(Unavailable, match="shutting down"):
                    client.generate("hi", max_tokens=1)
        reader.join(120)
        assert drained.result(60) is True
        tokens = [t for c in result["chunks"] for t in c.token_ids]
        assert len(tokens) == 300 and result["chunks"][-1].finish_reason == "length"
    finally:
        server.close()
    wait_for(lambda: router_idle(cl) and pools_whole(cl), what="router idle and every pool whole")
