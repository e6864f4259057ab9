"""The brigade.v1.Brigade service: requests in, router chunks out, errors as gRPC status codes.

Handlers run on the gRPC server's event loop and take the raw request bytes: a request that
does not parse is INVALID_ARGUMENT here (gRPC's own deserialiser would answer INTERNAL).
Tokenizing and validating happen before anything reaches the router, so a refused request
costs no worker anything. The handler's task is cancelled when the client goes away or its
deadline passes; leaving the backend's stream then aborts the request on its workers and
frees its KV (cluster/backend.py).

Status codes, from router/errors.py's table: INVALID_ARGUMENT (trailing `brigade-field` names
the field; a string field whose bytes are not UTF-8 by its path, router/grpc/wire_text.py),
NOT_FOUND (another model), RESOURCE_EXHAUSTED (router queue full, or too many long prompts
waiting to be tokenized; over-size messages are refused by gRPC itself), UNAVAILABLE (no live
worker), each retriable one with trailing `retry-after-ms`; and the door's own:
UNAUTHENTICATED, UNAVAILABLE while starting or draining. The request's `session_id` and
`priority` fields are accepted and not used (no session affinity or priority queues yet).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from brigade_client.errors import FIELD_KEY, RETRY_AFTER_KEY, STARTED_KEY, TOKENS_SENT_KEY
from brigade_client.v1 import brigade_pb2 as pb
from google.protobuf.message import DecodeError

from engine.messages import Chunk, GenerateRequest
from engine.sampling import InvalidRequest
from router import errors
from router.auth import Authenticator, cache_salt
from router.backend import Backend
from router.errors import ModelNotFound, StreamBroken
from router.grpc import messages as msgs
from router.grpc.wire_text import bad_text_field
from router.metrics import FrontDoorMetrics

log = logging.getLogger(__name__)
SERVICE = "brigade.v1.Brigade"
DOOR = "grpc"
RETRY_AFTER_MS = 1000


class Refused(Exception):
    """A request answered with a status code rather than a result."""

    def __init__(self, code: grpc.StatusCode, message: str, outcome: str, field: str | None = None,
                 retry: bool = False, tokens_sent: int | None = None):
        super().__init__(message)
        self.code, self.outcome, self.field, self.retry = code, outcome, field, retry
        self.tokens_sent = tokens_sent
        self.started = False

    def trailers(self) -> tuple[tuple[str, str], ...]:
        out = ((FIELD_KEY, self.field),) if self.field else ()
        if self.tokens_sent is not None:
            out += ((TOKENS_SENT_KEY, str(self.tokens_sent)),)
        if self.started:  # tokens existed: a retry would run the request again, so no hint either
            return out + ((STARTED_KEY, "1"),)
        return out + (((RETRY_AFTER_KEY, str(RETRY_AFTER_MS)),) if self.retry else ())


def refusal(exc: Exception) -> Refused:
    """The status for an exception from the backend (router/errors.py's table)."""
    if isinstance(exc, Refused):
        return exc
    row = errors.answer(exc)
    if row is errors.INTERNAL:
        return Refused(grpc.StatusCode.INTERNAL, errors.internal_message(exc), "error")
    field = exc.field if isinstance(exc, InvalidRequest) else "model" if isinstance(exc, ModelNotFound) else None
    tokens_sent = exc.tokens_sent if isinstance(exc, StreamBroken) else None  # the client knows how far it got
    return Refused(grpc.StatusCode[row.grpc_code], errors.safe_text(exc), row.outcome, field, row.retry, tokens_sent)


class DoorState:
    """What the service shares with its server: the backend once attached, the drain flag."""

    def __init__(self, auth: Authenticator, metrics: FrontDoorMetrics):
        self.auth, self.metrics = auth, metrics
        self.backend: Backend | None = None
        self.draining = False
        self.in_flight = 0


class BrigadeService:
    def __init__(self, state: DoorState):
        self.state = state

    def handlers(self) -> grpc.GenericRpcHandler:
        """Raw-bytes handlers (no request deserialiser, see the module doc)."""
        out = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self.generate, response_serializer=pb.GenerateChunk.SerializeToString),
            "GenerateUnary": grpc.unary_unary_rpc_method_handler(
                self.generate_unary, response_serializer=pb.GenerateResponse.SerializeToString),
            "ListModels": grpc.unary_unary_rpc_method_handler(
                self.list_models, response_serializer=pb.ListModelsResponse.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self.tokenize, response_serializer=pb.TokenizeResponse.SerializeToString),
            "Detokenize": grpc.unary_unary_rpc_method_handler(
                self.detokenize, response_serializer=pb.DetokenizeResponse.SerializeToString),
        }
        return grpc.method_handlers_generic_handler(SERVICE, out)

    # -- generation ---------------------------------------------------------------------
    async def generate(self, data: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateChunk]:
        async with self._answering(context) as run:
            req, reply_id, with_logprobs = await self._generate_request(data, context)
            async with contextlib.aclosing(self.state.backend.generate(req)) as chunks:
                async for chunk in chunks:
                    run.seen(chunk)
                    yield msgs.chunk_message(chunk, reply_id, with_logprobs)

    async def generate_unary(self, data: bytes, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        got: list[Chunk] = []
        async with self._answering(context) as run:
            req, reply_id, with_logprobs = await self._generate_request(data, context)
            async with contextlib.aclosing(self.state.backend.generate(req)) as chunks:
                async for chunk in chunks:
                    run.seen(chunk)
                    got.append(chunk)
        return msgs.response_message(got, reply_id, with_logprobs)

    @contextlib.asynccontextmanager
    async def _answering(self, context: grpc.aio.ServicerContext) -> AsyncIterator[_Run]:
        """One generation's bookkeeping around its body: a failure becomes the call's status
        (context.abort raises, so the body's caller never goes on after a refusal), a client
        that left or ran out of time is counted as such."""
        run = _Run(self.state)
        try:
            yield run
            run.outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            run.gone(context)
            raise
        except Exception as exc:
            run.refuse(exc)
        finally:
            run.done()
        if run.refused is not None:
            await _abort(context, run.refused)

    async def _generate_request(self, data: bytes, context) -> tuple[GenerateRequest, str, bool]:
        """The router's request (tokenized, checked), the id replies carry, whether to send logprobs.
        Parsing, the chat template and the tokenizer run on a worker thread: a long prompt never
        holds the event loop that also answers health checks."""
        tenant = self._admit(context)
        return await asyncio.to_thread(self._build_request, data, tenant)

    def _build_request(self, data: bytes, tenant: str) -> tuple[GenerateRequest, str, bool]:
        msg = _parse(pb.GenerateRequest, data)
        backend = self.state.backend
        if msg.model and msg.model != backend.model_name:
            raise ModelNotFound(msg.model, backend.model_name)
        params = msgs.sampling_params(msg.sampling)
        kind, value = msgs.prompt(msg)
        ids = backend.chat_token_ids(value) if kind == "chat" else backend.tokenize(value)
        if kind == "chat" and not msg.sampling.HasField("max_tokens"):  # as the HTTP door's chat
            params = dataclasses.replace(params, max_tokens=backend.output_room(ids))
        backend.validate(ids, params)
        internal = f"grpc-{uuid.uuid4().hex}"
        salt = cache_salt(tenant, msg.cache_salt or None)  # the same rule as the HTTP door
        req = GenerateRequest(internal, ids, params, cache_salt=salt)
        return req, msg.request_id or internal, params.logprobs is not None

    # -- the rest -----------------------------------------------------------------------
    async def list_models(self, data: bytes, context) -> pb.ListModelsResponse:
        def work() -> pb.ListModelsResponse:
            _parse(pb.ListModelsRequest, data)
            b = self.state.backend
            return pb.ListModelsResponse(models=[pb.Model(id=b.model_name, max_model_len=b.max_model_len,
                                                          vocab_size=b.vocab_size)])
        return await self._simple(context, work)

    async def tokenize(self, data: bytes, context) -> pb.TokenizeResponse:
        def work() -> pb.TokenizeResponse:
            msg = _parse(pb.TokenizeRequest, data)
            b, kind = self.state.backend, msg.WhichOneof("input")
            if kind is None:
                raise InvalidRequest("input", "set text or chat")
            ids = b.chat_token_ids(msgs.messages(msg.chat)) if kind == "chat" else b.tokenize(msg.text)
            return pb.TokenizeResponse(token_ids=ids)
        return await self._simple(context, work)

    async def detokenize(self, data: bytes, context) -> pb.DetokenizeResponse:
        def work() -> pb.DetokenizeResponse:
            ids = list(_parse(pb.DetokenizeRequest, data).token_ids)
            return pb.DetokenizeResponse(text=self.state.backend.detokenize(ids))
        return await self._simple(context, work)

    async def _simple(self, context, work):
        """Admit the caller, then answer `work()` on a worker thread (the tokenizer, a template or a
        long Detokenize must not hold the event loop that answers health checks)."""
        try:
            self._admit(context)
            return await asyncio.to_thread(work)
        except Exception as exc:
            refused = refusal(exc)
        await _abort(context, refused)

    def _admit(self, context) -> str:
        """The caller's tenant, once the server can take the request."""
        tenant = self.state.auth.tenant(_metadata(context).get("authorization"))
        if tenant is None:
            raise Refused(grpc.StatusCode.UNAUTHENTICATED, "authorization: missing or unknown bearer token "
                          "(send metadata 'authorization: Bearer TOKEN')", "unauthenticated")
        if self.state.draining:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "server is shutting down; retry on another replica",
                          "unavailable", retry=True)
        if self.state.backend is None:
            raise Refused(grpc.StatusCode.UNAVAILABLE, "server is starting; retry shortly", "unavailable",
                          retry=True)
        return tenant


class _Run:
    """One generation's bookkeeping: in-flight counts, TTFT, the metrics at the end."""

    def __init__(self, state: DoorState):
        self.state = state
        self.refused: Refused | None = None
        self.outcome = "error"
        self.start = time.monotonic()
        self.ttft: float | None = None
        self.last: Chunk | None = None
        self.chunks = 0
        state.in_flight += 1
        state.metrics.in_flight.labels(DOOR).inc()

    def seen(self, chunk: Chunk) -> None:
        self.chunks += 1
        if self.ttft is None and chunk.token_ids:
            self.ttft = time.monotonic() - self.start
        if chunk.finished:
            self.last = chunk

    def refuse(self, exc: Exception) -> None:
        self.refused = refusal(exc)
        self.refused.started = self.chunks > 0
        self.outcome = self.refused.outcome

    def gone(self, context) -> None:
        """The client left, or its deadline passed (gRPC cancels the handler either way)."""
        remaining = context.time_remaining()
        self.outcome = "deadline" if remaining is not None and remaining <= 0 else "cancelled"

    def done(self) -> None:
        self.state.in_flight -= 1
        self.state.metrics.in_flight.labels(DOOR).dec()
        total = time.monotonic() - self.start if self.last is not None else None
        self.state.metrics.finished(DOOR, self.outcome, self.ttft, total, self.last.usage if self.last else None)


def _parse(cls, data: bytes):
    try:
        return cls.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:  # upb raises DecodeError; be liberal
        error = exc
    field = bad_text_field(cls.DESCRIPTOR, data)
    if field is not None:
        raise InvalidRequest(field, "is not valid UTF-8 text; send UTF-8 (no lone surrogates)")
    raise InvalidRequest("request", f"not a valid {cls.DESCRIPTOR.full_name}: {error}")


def _metadata(context) -> dict[str, str]:
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


async def _abort(context, refused: Refused) -> None:
    await context.abort(refused.code, str(refused), trailing_metadata=refused.trailers())
