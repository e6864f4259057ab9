"""The HTTP front door's backend for the cluster: checks requests in the driver, streams them
through the RouterActor.

Tokenizing and validating need only the checkpoint's tokenizer.json and config.json (no
weights, no engine), so a bad request is refused here with the engine's own message
(`engine.llm_engine.check_request`) before it costs the router or a worker anything. The KV
pool size is the smallest any worker reported at start.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Iterator

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from cluster.config import ClusterConfig
from engine.engine_setup import context_length, model_id_for
from engine.llm_engine import check_request
from engine.model_config import ModelConfig
from engine.presets import resolve_model
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer, chat_token_ids, prompt_token_ids
from router.types import Chunk, GenerateRequest, NoWorker

log = logging.getLogger(__name__)
ABORT_DRAIN_S = 5.0  # how long an aborted stream may take to end before its task is cancelled
STATUS_TIMEOUT_S = 5.0


class ClusterBackend:
    """Built from the config alone (a bad --model fails here, before Ray starts); serves once
    attach()ed to the launched cluster."""

    def __init__(self, cfg: ClusterConfig):
        path = resolve_model(cfg.model)
        model_cfg = ModelConfig.from_dir(path)
        self.tokenizer = Tokenizer.from_dir(path)
        self.model_name = model_id_for(cfg.engine_config(None), path)
        self.vocab_size = model_cfg.vocab_size
        self.max_model_len = context_length(cfg.engine.max_model_len, model_cfg)
        self.block_size = cfg.engine.block_size
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

    def chat_token_ids(self, messages: list[dict]) -> list[int]:
        return chat_token_ids(self.tokenizer, messages)

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        check_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                      block_size=self.block_size, num_blocks=self.num_blocks)

    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams) -> Iterator[Chunk]:
        stream = self.router.generate.remote(GenerateRequest(request_id, token_ids, params))
        finished = False
        try:
            for ref in stream:
                chunk = _get(ref)
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        finally:
            if not finished:  # the client left, or the stream failed: free the request's KV
                self._abort(request_id, stream)

    def health(self) -> tuple[bool, dict]:
        try:
            status = ray.get(self.router.status.remote(), timeout=STATUS_TIMEOUT_S)
        except (RayActorError, GetTimeoutError) as exc:
            return False, {"reason": f"the router does not answer: {type(exc).__name__}"}
        live = Counter(w["role"] for w in status["workers"].values() if w["healthy"])
        details = {"workers": {role: live[role] for role in self.roles},
                   "running": status["running"], "waiting": status["waiting"]}
        missing = [role for role in self.roles if not live[role]]
        if missing:
            details["reason"] = f"no live {' or '.join(missing)} worker"
        return not missing, details

    # -- helpers ------------------------------------------------------------------------
    def _abort(self, request_id: str, stream) -> None:
        """Abort at the router (which frees the KV on the workers and ends the stream with
        finish_reason "abort"), read the stream to its end; cancel the router's task if it
        does not end within ABORT_DRAIN_S (e.g. the request had not reached a worker yet)."""
        try:
            aborted = ray.get(self.router.abort.remote(request_id), timeout=STATUS_TIMEOUT_S)
        except Exception as exc:
            log.warning("abort of %s failed: %s", request_id, exc)
            aborted = False
        deadline = time.monotonic() + ABORT_DRAIN_S
        try:
            while aborted and (left := deadline - time.monotonic()) > 0:
                ready, _ = ray.wait([stream], timeout=left)
                if not ready:
                    break
                if ray.get(next(stream)).finished:
                    return
        except StopIteration:
            return
        except Exception as exc:  # the stream failed: nothing more to read
            log.debug("aborted stream %s ended with %r", request_id, exc)
            return
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
