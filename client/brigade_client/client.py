"""The synchronous client."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from brigade_client import _calls
from brigade_client.errors import BrigadeError, from_rpc_error
from brigade_client.types import Chunk, Completion, Model, chunk_from_pb, completion_from_pb
from brigade_client.v1 import brigade_pb2 as pb
from brigade_client.v1 import brigade_pb2_grpc


class Client:
    """A Brigade gRPC client. `with Client("127.0.0.1:50051") as c: print(c.generate("Hi").text)`

    `token` is sent as `authorization: Bearer TOKEN`; `tls=True` (or `root_certificates`, PEM
    bytes or a file) makes the channel TLS. `timeout` is the default per-call timeout in
    seconds (retries included); UNAVAILABLE before the first token is retried up to
    `max_retries` times with jittered backoff.
    """

    def __init__(self, target: str, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, server_name: str | None = None,
                 timeout: float | None = None, max_retries: int = 3):
        creds = _calls.credentials(tls, root_certificates)
        options = _calls.channel_options(server_name)
        self._channel = (grpc.secure_channel(target, creds, options) if creds
                         else grpc.insecure_channel(target, options))
        self._stub = brigade_pb2_grpc.BrigadeStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._metadata = _calls.metadata(token)
        self.timeout, self.max_retries = timeout, max_retries

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    # -- generation -----------------------------------------------------------------------
    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               timeout: float | None = None, **options) -> Iterator[Chunk]:
        """Chunks as they come; the last has `finished`. Closing the iterator early cancels the
        call, and the server aborts the work."""
        req = _calls.generate_request(prompt, messages=messages, **options)
        deadline = _calls.Deadline(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            call = self._stub.Generate(req, timeout=deadline.left(), metadata=self._metadata)
            started = False
            try:
                for msg in call:
                    started = True
                    yield chunk_from_pb(msg)
                return
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                delay = None if started else _calls.retry_delay(err, attempt, self.max_retries, deadline)
                if delay is None:
                    raise err from None
            finally:
                call.cancel()  # a no-op once the stream ended
            time.sleep(delay)
            attempt += 1

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None, **options) -> Completion:
        """The whole completion (GenerateUnary)."""
        req = _calls.generate_request(prompt, messages=messages, **options)
        return completion_from_pb(self._unary(self._stub.GenerateUnary, req, timeout, retry=True))

    def chat(self, messages: list[dict], *, timeout: float | None = None, **options) -> Completion:
        """`messages` ([{"role": "user", "content": "..."}]) through the model's chat template."""
        return self.generate(messages=messages, timeout=timeout, **options)

    # -- the rest -------------------------------------------------------------------------
    def models(self, *, timeout: float | None = None) -> list[Model]:
        resp = self._unary(self._stub.ListModels, pb.ListModelsRequest(), timeout, retry=True)
        return [Model(m.id, m.max_model_len, m.vocab_size) for m in resp.models]

    def tokenize(self, text: str | None = None, *, messages: list[dict] | None = None,
                 timeout: float | None = None) -> list[int]:
        resp = self._unary(self._stub.Tokenize, _calls.tokenize_request(text, messages), timeout, retry=True)
        return list(resp.token_ids)

    def detokenize(self, token_ids: list[int], *, timeout: float | None = None) -> str:
        return self._unary(self._stub.Detokenize, pb.DetokenizeRequest(token_ids=token_ids), timeout, retry=True).text

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """"SERVING" or "NOT_SERVING" (grpc.health.v1); `service` "" is the whole server."""
        resp = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout, retry=False)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def _unary(self, method, req, timeout: float | None, retry: bool):
        deadline = _calls.Deadline(timeout if timeout is not None else self.timeout)
        attempt = 0
        while True:
            try:
                return method(req, timeout=deadline.left(), metadata=self._metadata)
            except grpc.RpcError as exc:
                err: BrigadeError = from_rpc_error(exc)
                delay = _calls.retry_delay(err, attempt, self.max_retries, deadline) if retry else None
                if delay is None:
                    raise err from None
            time.sleep(delay)
            attempt += 1
