"""A prefill worker: an engine in prefill role whose requests end at their first token.

Each request's KV is copied out of the pool when its first token exists and held until the
chosen decode worker pulls it (`push`), which sends it over that decode worker's channel. Plain class: the
Ray actor in actor.py only adapts its futures to asyncio.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from engine import EngineConfig, KVExport, LLMEngine, RequestOutput, Role
from engine.engine_loop import EngineLoop
from kv_transfer import KVLayout, KVTransferError, SenderChannel, TransferConfig, connect
from kv_transfer.leases import LeaseSweeper
from kv_transfer.reshard import ShardedSender, connect_group
from router.config import IndexLink
from router.index_publisher import with_events, worker_publisher
from router.types import Aborted, GenerateRequest, PrefillResult

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 index: IndexLink | None = None):
        self.worker_id = worker_id
        engine_cfg = with_events(engine_cfg, index is not None)
        self.engine = LLMEngine(engine_cfg.model_copy(update={"role": Role.PREFILL}))
        self.loop = EngineLoop(self.engine, name=f"{worker_id}-engine").start()
        # Its lease and cache events in Redis, when the cluster has an index (else none).
        self.publisher = worker_publisher(index, worker_id, "prefill", self.loop, True) if index else None
        self.layout = KVLayout.of_model(self.engine.model_id, self.engine.runner.kv_cache,
                                        self.engine.model_config.num_kv_heads)
        self.transfer_cfg = transfer_cfg
        self.channels: dict[str, SenderChannel | ShardedSender] = {}
        # One thread per channel: sends leave in the order decode workers pulled them.
        self.senders: dict[str, ThreadPoolExecutor] = {}
        # Prefilled requests' KV, copied out of the pool, until their decode worker pulls it.
        self.exports: dict[str, KVExport] = {}
        self.exported_at: dict[str, float] = {}
        # Prefills not yet answered: abort() must answer them, as the engine then reports nothing.
        self.pending: dict[str, Future[PrefillResult]] = {}
        self.sweeper = LeaseSweeper(self.drop_stale_exports, LeaseSweeper.interval_for(transfer_cfg.hold_timeout_s),
                                    f"{worker_id}-leases")

    def connect(self, decode_id: str, address: tuple[str, int] | list[tuple[str, int]]) -> None:
        """Join decode worker `decode_id`'s transfer server (blocks until it accepts). A list of
        addresses is a tensor-parallel decode worker, one per rank: each rank gets its own pair
        and, per request, exactly its KV heads (kv_transfer.reshard). Replaces an existing pair
        with that worker (the router rebuilds a pair whose link failed)."""
        self.disconnect(decode_id)
        if isinstance(address, list):
            self.channels[decode_id] = connect_group(address, self.layout, self.transfer_cfg, self.worker_id)
        else:
            self.channels[decode_id] = connect(address, self.layout, self.transfer_cfg, name=self.worker_id)
        self.senders[decode_id] = ThreadPoolExecutor(1, thread_name_prefix=f"{self.worker_id}-to-{decode_id}")

    def disconnect(self, decode_id: str) -> None:
        channel = self.channels.pop(decode_id, None)
        if channel is not None:
            channel.close()
        sender = self.senders.pop(decode_id, None)
        if sender is not None:
            sender.shutdown(wait=False)

    def drop_stale_exports(self) -> list[str]:
        """Forget exports no decode worker pulled within transfer.hold_timeout_s."""
        deadline = time.monotonic() - self.transfer_cfg.hold_timeout_s
        stale = [rid for rid, t in list(self.exported_at.items()) if t < deadline]
        for rid in stale:  # pop, not del: push() on a sender thread may take it meanwhile
            self.exports.pop(rid, None)
            self.exported_at.pop(rid, None)
            log.warning("dropped the KV of %s: no decode worker pulled it", rid)
        return stale

    def prefill(self, req: GenerateRequest) -> Future[PrefillResult]:
        self.drop_stale_exports()
        result: Future[PrefillResult] = Future()
        start = time.monotonic()
        self.pending[req.request_id] = result
        result.add_done_callback(lambda _: self.pending.pop(req.request_id, None))

        def sink(out: RequestOutput | BaseException) -> None:  # on the engine's loop thread
            if isinstance(out, BaseException):
                if not result.done():
                    result.set_exception(out)
                return
            if result.done():  # aborted before the engine had it (abort raced add_request): answered already
                if out.kv_ready:
                    self.engine.export_kv(req.request_id)  # hands its blocks back; nobody will pull it
                return
            if out.kv_ready:
                # Copy the KV out now, in the same loop turn: a later pull then waits for no
                # engine step, and the blocks go back to the pool (full ones stay cached).
                self.exports[req.request_id] = self.engine.export_kv(req.request_id)
                self.exported_at[req.request_id] = time.monotonic()
            result.set_result(PrefillResult(
                req.request_id, out.new_token_ids[0], out.new_text, out.finished, out.finish_reason, out.usage,
                out.logprobs[-1] if out.logprobs else None, queue_s=0.0, prefill_s=time.monotonic() - start))

        added = self.loop.add_request(req.request_id, req.prompt_token_ids, req.params, sink, req.cache_salt)
        added.add_done_callback(lambda f: f.exception() is not None and not result.done()
                                and result.set_exception(f.exception()))
        return result

    def push(self, request_id: str, decode_id: str) -> bool:
        """Queue a prefilled request's exported KV for sending to `decode_id`.

        True means a send will follow on that channel (the caller may now receive); False
        means this worker does not hold the request (aborted, or never prefilled here).
        """
        channel = self.channels.get(decode_id)
        if channel is None:
            return False
        export = self.exports.pop(request_id, None)
        self.exported_at.pop(request_id, None)
        if export is None:
            return False

        def send() -> None:
            try:
                channel.send(export.request_id, export.kv, export.num_tokens)
            except KVTransferError as exc:  # the receiving side sees it too and recovers
                log.warning("sending KV of %s to %s failed: %s", request_id, decode_id, exc)

        self.senders[decode_id].submit(send)
        return True

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id).result()
        self.exports.pop(request_id, None)
        self.exported_at.pop(request_id, None)
        # The loop no longer calls this request's sink, so nothing else will answer its caller.
        pending = self.pending.pop(request_id, None)
        if pending is not None and not pending.done():
            pending.set_exception(Aborted(f"request {request_id!r} was aborted during prefill"))

    def corrupt_next_payload(self, decode_id: str) -> None:
        """Test hook: flip one byte of the next payload sent to `decode_id`."""
        self.channels[decode_id].corrupt_next_payload = True

    def health(self) -> dict:
        return worker_health(self.worker_id, self.loop, self.publisher, self.channels)

    def stats(self) -> dict:
        return self.loop.call(lambda e: e.stats()).result() | {
            "channels": sorted(self.channels), "pinned_exports": len(self.exports)}

    def close(self) -> None:
        self.sweeper.stop()
        if self.publisher is not None:
            self.publisher.stop()  # ends the lease first: no new requests are routed here
        for decode_id in list(self.channels):
            self.disconnect(decode_id)
        self.loop.stop()
        self.engine.close()  # after the loop: finishes pending HiCache disk writes


def worker_health(worker_id: str, loop: EngineLoop, publisher, channels: dict | None = None) -> dict:
    """What the router's health check reads: liveness, what it hashes with, its load, and the
    peers whose KV link failed (the router rebuilds those pairs).
    (Unlocked reads of two counters from the engine thread: a hint, like the index.)"""
    e = loop.engine
    return {"worker_id": worker_id, **loop.health(), "model_id": e.model_id, "block_size": e.block_size,
            "free_blocks": e.pool.num_free, "running": len(e.scheduler.running),
            "broken_pairs": sorted(peer for peer, ch in list((channels or {}).items()) if ch.broken),
            "index": publisher.status() if publisher is not None else None, **e.runner.health()}
