"""The asyncio client: the same calls as Client, awaited."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from brigade_client import _calls
from brigade_client.errors import BrigadeError, from_rpc_error
from brigade_client.types import Chunk, Completion, Model, chunk_from_pb, completion_from_pb
from brigade_client.v1 import brigade_pb2 as pb
from brigade_client.v1 import brigade_pb2_grpc


class AsyncClient:
    """`async with AsyncClient("127.0.0.1:50051") as c: print((await c.generate("Hi")).text)`

    Options as for Client. Create it inside the event loop that uses it.
    """

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, server_name: str | None = None,
                 timeout: float | None = None, max_retries: int = 3):
        creds = _calls.credentials(tls, root_certificates)
        options = _calls.channel_options(server_name)
        self._channel = (grpc.aio.secure_channel(target, creds, options) if creds
                         else grpc.aio.insecure_channel(target, options))
        self._stub = brigade_pb2_grpc.BrigadeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _calls.metadata(token)
        self.timeout, self.max_retries = timeout, max_retries

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     timeout: float | None = None, **options) -> AsyncIterator[Chunk]:
        """Chunks as they come; leaving the loop early (or cancelling the task) cancels the call,
        and the server aborts the work."""
        req = _calls.generate_request(prompt, messages=messages, **options)
        deadline = _calls.Deadline(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            call = self._stub.Generate(req, timeout=deadline.left(), metadata=self._metadata)
            started = False
            try:
                async for msg in call:
                    started = True
                    yield chunk_from_pb(msg)
                return
            except grpc.aio.AioRpcError as exc:
                err = from_rpc_error(exc)
                delay = None if started else _calls.retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise err from None
            finally:
                call.cancel()
            await asyncio.sleep(delay)
            attempt += 1

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       timeout: float | None = None, **options) -> Completion:
        req = _calls.generate_request(prompt, messages=messages, **options)
        return completion_from_pb(await self._unary(self._stub.GenerateUnary, req, timeout, retry=True))

    async def chat(self, messages: list[dict], *, timeout: float | None = None, **options) -> Completion:
        return await self.generate(messages=messages, timeout=timeout, **options)

    async def models(self, *, timeout: float | None = None) -> list[Model]:
        resp = await self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout, retry=True)
        return [Model(m.id, m.max_model_len, m.vocab_size) for m in resp.models]

    async def tokenize(self, text: str | None = None, *, messages: list[dict] | None = None,
                       timeout: float | None = None) -> list[int]:
        resp = await self._unary(self._stub.Tokenize, _calls.tokenize_request(text, messages), timeout, retry=True)
        return list(resp.token_ids)

    async def detokenize(self, token_ids: list[int], *, timeout: float | None = None) -> str:
        resp = await self._unary(self._stub.Detokenize, pb.DetokenizeRequest(token_ids=token_ids), timeout, True)
        return resp.text

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        resp = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout,
                                 retry=False)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def _unary(self, method, req, timeout: float | None, retry: bool):
        deadline = _calls.Deadline(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                return await method(req, timeout=deadline.left(), metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                err: BrigadeError = from_rpc_error(exc)
                delay = _calls.retry_delay(err, attempt, self.max_retries, deadline) if retry else None
                if delay is None:
                    raise err from None
            await asyncio.sleep(delay)
            attempt += 1
