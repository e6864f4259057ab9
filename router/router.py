"""The request loop: admit a request, run it, and migrate it when a worker dies under it.

Collaborators, each in its own file: admission (router/admission.py), the worker pool with
its pairing and health loop (router/pool.py), the routing policy (router/policy.py), one
attempt on its workers (router/dispatch.py), the prefix index (router/index/). Workers are
WorkerClients (router/workers.py); the router knows no Ray. A request whose worker dies
continues on another from the tokens already sent (router/migration.py), at most
RouterConfig.max_migrations times; a request whose engine died under it twice (it was in the
batch of both failed steps) is failed for good with PoisonRequest instead, so one request
that kills engines cannot take down one worker after another.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator

from engine.messages import Chunk, GenerateRequest, Timing
from engine.outputs import Usage
from router.admission import Admission
from router.config import RouterConfig
from router.dispatch import Attempt, Dispatch, abort_chunk
from router.errors import NoWorker, PoisonRequest, StreamBroken, WorkerLost
from router.index.view import IndexView
from router.migration import continuation
from router.policy import Picker
from router.pool import WorkerPool
from router.workers import WorkerClient

log = logging.getLogger(__name__)


class Router:
    def __init__(self, cfg: RouterConfig, colocated: bool, index: IndexView | None = None, owns_pairs: bool = True):
        """`owns_pairs=False`: an extra front's router over workers another router pairs (router/pool.py)."""
        self.colocated, self.index = colocated, index
        self.pool = WorkerPool(cfg, colocated, index, owns_pairs)
        self.picker = Picker(cfg, self.pool, index)
        self.dispatch = Dispatch(self.picker, colocated, cfg.decode_wait_s)
        self.admission = Admission(cfg)

    @property
    def cfg(self) -> RouterConfig:
        return self.picker.cfg

    @cfg.setter
    def cfg(self, cfg: RouterConfig) -> None:
        """New routing settings at run time (benchmarks compare policies on the same workers)."""
        self.picker.cfg = self.pool.cfg = self.admission.cfg = cfg

    async def add_worker(self, client: WorkerClient) -> None:
        await self.pool.add(client)

    async def remove_worker(self, worker_id: str) -> bool:
        return await self.pool.remove(worker_id)

    async def abort(self, request_id: str) -> bool:
        return await self.dispatch.abort(request_id)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """The request's chunks, the last one `finished` with usage, timing and its workers."""
        arrived = time.monotonic()
        async with self.admission.slot(len(req.prompt_token_ids)) as slot:
            timing = Timing(queue_s=slot.waited_s)
            try:
                first = True
                async for chunk, prefill, decode in self._migrating(req, timing):
                    if first and chunk.token_ids:
                        timing.ttft_s, first = time.monotonic() - arrived, False
                    if chunk.finished:
                        timing.total_s = time.monotonic() - arrived
                        chunk = dataclasses.replace(chunk, timing=timing,
                                                    prefill_worker=prefill.worker_id if prefill else None,
                                                    decode_worker=decode.worker_id if decode else None)
                        # Its workers are done with it. Free the slot before the answer leaves:
                        # this generator resumes only once the reader takes the chunk (the doors
                        # read through a window), and a client that got its answer may already
                        # have sent its next request.
                        slot.release()
                    elif chunk.timing is not None:  # a worker's report, folded into the request's timing
                        chunk = dataclasses.replace(chunk, timing=None)
                    yield chunk
            finally:
                self.dispatch.forget(req.request_id)

    async def _migrating(self, req: GenerateRequest, timing: Timing) -> Attempt:
        """The request's chunks; when a worker dies under it, the rest comes from a continuation
        (prompt + the tokens sent) on other workers, so the client sees every token once."""
        sent: list[int] = []
        chars = 0  # characters of text sent (a continuation resumes its text after them)
        avoid: set[str] = set()  # workers that failed this request
        engine_deaths: list[str] = []  # workers whose engine died with this request in its batch
        attempt = req
        while True:
            try:
                async for chunk, prefill, decode in self.dispatch.attempt(attempt, req.request_id, timing, avoid):
                    sent += chunk.token_ids
                    chars += len(chunk.text)
                    if attempt is not req:  # a continuation: the client knows the request by its own id
                        usage = chunk.usage
                        if chunk.finished and usage is not None:
                            usage = dataclasses.replace(
                                usage, prompt_tokens=len(req.prompt_token_ids), completion_tokens=len(sent),
                                cached_tokens=min(usage.cached_tokens, len(req.prompt_token_ids)))
                        chunk = dataclasses.replace(chunk, request_id=req.request_id, usage=usage)
                    yield chunk, prefill, decode
                return
            except WorkerLost as lost:
                if req.request_id in self.dispatch.aborted:
                    yield abort_chunk(req.request_id), None, None
                    return
                avoid.add(lost.worker_id)
                if lost.engine_died:
                    engine_deaths.append(lost.worker_id)
                if len(engine_deaths) >= 2:  # migrated once already after an engine death: do not feed a third
                    log.error("request %s was in the batch of two engine deaths (%s): failing it for good",
                              req.request_id, ", ".join(engine_deaths))
                    raise PoisonRequest(f"request {req.request_id} was in the batch of two engine failures in a "
                                        f"row ({', '.join(engine_deaths)}) after {len(sent)} tokens: it is not tried "
                                        "again; check its parameters, or report it with the server's logs") from None
                if timing.migrations >= self.cfg.max_migrations:
                    raise StreamBroken(len(sent), f"worker {lost.worker_id} died after {len(sent)} tokens were "
                                                  f"sent and the request already moved {timing.migrations} times "
                                                  f"(max_migrations); retry") from None
                timing.migrations += 1
                log.warning("worker %s died under %s after %d tokens; migrating (%d of at most %d)",
                            lost.worker_id, req.request_id, len(sent), timing.migrations, self.cfg.max_migrations)
            except NoWorker as exc:
                if attempt is req or isinstance(exc, StreamBroken):
                    raise
                raise StreamBroken(len(sent), f"{exc} ({len(sent)} tokens were sent)") from None
            if len(sent) >= req.params.max_tokens:  # everything was sent but the last chunk
                usage = Usage(len(req.prompt_token_ids), len(sent), 0)
                yield Chunk(req.request_id, [], "", True, "length", usage), None, None
                return
            if req.request_id in self.dispatch.aborted:
                yield abort_chunk(req.request_id), None, None
                return
            attempt = continuation(req, sent, chars, timing.migrations) if sent else dataclasses.replace(
                req, request_id=f"{req.request_id}#m{timing.migrations}")

    def status(self) -> dict:
        return {**self.admission.status(), "colocated": self.colocated, "policy": self.cfg.policy,
                "kv_picks": dict(self.picker.kv_picks),
                "index": self.index.status() if self.index is not None else {"available": False, "error": "no Redis"},
                "workers": self.pool.status()}
