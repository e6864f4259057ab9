"""The front doors' backend for the cluster (router/backend.py's Backend): checks requests in
the driver, streams them through the RouterActor. Both doors call the one async generate()
(one thread per stream reads the router's stream with blocking gets and hands chunks to the
caller's loop: cheaper per chunk than iterating Ray's stream asynchronously) and health(),
neither of which blocks the loop.

Tokenizing and validating need only the checkpoint's tokenizer.json and config.json (no
weights, no engine), so a bad request is refused here with the engine's own message
(`engine.request_checks.check_request`) before it costs the router or a worker anything. The KV
pool size is the smallest any worker reported at start. A text longer than max_model_len tokens
could spell is refused before it is tokenized; a long one is tokenized with the GIL released,
a bounded number at once (router/tokenize_slots.py), so the doors' other threads go on.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError, RayTaskError

from cluster.config import ClusterConfig
from engine.engine_setup import context_length, model_id_for
from engine.messages import STREAM_WINDOW_CHUNKS, Chunk, GenerateRequest
from engine.model_config import ModelConfig
from engine.presets import resolve_model
from engine.request_checks import check_request, output_room
from engine.sampling import InvalidRequest, SamplingParams
from engine.tokenizer import Tokenizer, chat_token_ids, prompt_token_ids
from router.errors import NoWorker
from router.tokenize_slots import TokenizeSlots

log = logging.getLogger(__name__)
ABORT_DRAIN_S = 5.0  # how long an aborted stream may take to end before its task is cancelled
STATUS_TIMEOUT_S = 5.0
HAND_OVER_POLL_S = 0.5  # how often a reading thread waiting for room checks whether its caller left


class ClusterBackend:
    """Built from the config alone (a bad --model fails here, before Ray starts); serves once
    attach()ed to the launched cluster."""

    def __init__(self, cfg: ClusterConfig):
        path = resolve_model(cfg.model)
        model_cfg = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_dir(path)
        self.model_name = model_id_for(cfg.engine, path)
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = context_length(cfg.engine.max_model_len, model_cfg)
        if self.tokenizer is not None:  # a text no context can hold is refused before it is tokenized
            fd = cfg.frontdoor
            self.tokenizer.limit(self.max_model_len,
                                 TokenizeSlots(fd.max_concurrent_tokenizations, fd.max_waiting_tokenizations))
        self.block_size = cfg.engine.cache.block_size
        self.roles = ("mixed",) if cfg.mode == "colocated" else ("prefill", "decode")
        cfg.parallel.check_model(model_cfg, self.roles)
        self.router = None
        self.num_blocks = 0

    def attach(self, cluster) -> None:
        """Serve through `cluster` (a cluster.launch.Cluster); the pool size any request must fit
        is the smallest its workers report."""
        sizes = [s["num_blocks"] for s in cluster.stats().values() if "num_blocks" in s]
        if not sizes:
            raise RuntimeError("no worker reported its KV pool; see the worker logs above")
        self.router, self.num_blocks = cluster.router, min(sizes)

    # -- Backend ------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return prompt_token_ids(self.tokenizer, prompt)

    def chat_token_ids(self, messages: list[dict], **template) -> list[int]:
        return chat_token_ids(self.tokenizer, messages, **template)

    def detokenize(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            raise InvalidRequest("token_ids", "this model has no tokenizer.json")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("token_ids", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        check_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                      block_size=self.block_size, num_blocks=self.num_blocks)

    def output_room(self, token_ids: list[int]) -> int:
        return output_room(token_ids, max_model_len=self.max_model_len, block_size=self.block_size,
                           num_blocks=self.num_blocks)

    async def generate(self, req: GenerateRequest) -> AsyncIterator[Chunk]:
        """The request's chunks through the router. Leaving early (aclose(), or the task
        cancelled) aborts the request and frees its KV.

        A thread reads the router's stream with blocking ray.get and hands chunks to the loop:
        iterating a Ray streaming generator asynchronously costs several times more per chunk.
        It holds at most STREAM_WINDOW_CHUNKS unread: for a slow client it waits, the router's
        stream (backpressured by Ray) waits in turn, and nothing of the answer piles up here."""
        loop = asyncio.get_running_loop()
        stream = self.router.generate.remote(req)
        queue: asyncio.Queue[Chunk | BaseException] = asyncio.Queue(STREAM_WINDOW_CHUNKS)
        ended = asyncio.Event()  # the reading thread has stopped
        left = threading.Event()  # the caller has stopped reading: the thread reads on, dropping

        def hand_over(item: Chunk | BaseException) -> None:
            try:
                put = asyncio.run_coroutine_threadsafe(queue.put(item), loop)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                return
            while not left.is_set() and not loop.is_closed():
                try:
                    return put.result(HAND_OVER_POLL_S)
                except concurrent.futures.TimeoutError:
                    continue
                except (concurrent.futures.CancelledError, RuntimeError):
                    return
            put.cancel()

        def read() -> None:
            try:
                for ref in stream:
                    chunk = _get(ref)
                    hand_over(chunk)
                    if chunk.finished:
                        return
                hand_over(NoWorker("the router's stream ended without a last chunk; retry"))
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the reader
                hand_over(exc)
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is closed
                    loop.call_soon_threadsafe(ended.set)

        threading.Thread(target=read, name=f"stream-{req.request_id}", daemon=True).start()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the stream is over: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            left.set()
            if not finished:  # shielded: a second cancellation must not stop the abort half-way
                await asyncio.shield(self._abort(req.request_id, stream, ended))

    async def health(self) -> tuple[bool, dict]:
        try:
            status = await asyncio.wait_for(self.router.status.remote(), STATUS_TIMEOUT_S)
        except (RayActorError, asyncio.TimeoutError) as exc:
            return False, {"reason": f"the router does not answer: {type(exc).__name__}"}
        return self._health(status)

    async def worker_stats(self) -> dict[str, dict]:
        return await asyncio.wait_for(self.router.stats.remote(), STATUS_TIMEOUT_S)

    def _health(self, status: dict) -> tuple[bool, dict]:
        live = Counter(w["role"] for w in status["workers"].values() if w["healthy"])
        index = status["index"]  # Redis down only degrades routing: still healthy
        details = {"workers": {role: live[role] for role in self.roles},
                   "running": status["running"], "waiting": status["waiting"],
                   "peak": {"running": status["peak"]["running"], "waiting": status["peak"]["waiting"]},
                   "prefix_index": "ok" if index["available"] else f"unavailable ({index['error']})"}
        missing = [role for role in self.roles if not live[role]]
        if missing:
            details["reason"] = f"no live {' or '.join(missing)} worker"
        return not missing, details

    # -- helpers ------------------------------------------------------------------------
    async def _abort(self, request_id: str, stream, ended: asyncio.Event) -> None:
        """Abort at the router (which frees the KV on the workers and ends the stream with
        finish_reason "abort") while generate's thread reads the stream to its end; cancel the
        router's task if it does not end within ABORT_DRAIN_S (e.g. the request had not
        reached a worker yet)."""
        try:
            aborted = await asyncio.wait_for(self.router.abort.remote(request_id), STATUS_TIMEOUT_S)
        except Exception as exc:
            log.warning("abort of %s failed: %s", request_id, exc)
            aborted = False
        if aborted:
            try:
                await asyncio.wait_for(ended.wait(), ABORT_DRAIN_S)
                return
            except asyncio.TimeoutError:
                log.debug("aborted stream %s did not end in %s s", request_id, ABORT_DRAIN_S)
        ray.cancel(stream)


def _get(ref) -> Chunk:
    """ray.get, with the router's own exceptions (Overloaded, NoWorker, InvalidRequest...)
    unwrapped from Ray's task error, and a dead router as NoWorker."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        cause = exc.cause
        if isinstance(cause, RayActorError):
            raise NoWorker(f"a worker died mid-request ({type(cause).__name__}); retry") from None
        raise cause from None
    except RayActorError as exc:
        raise NoWorker(f"the router is down: {type(exc).__name__}; retry shortly") from None
