"""A prefill worker: an engine in prefill role whose requests end at their first token.

Each request's KV is copied out of the pool when its first token exists and held until the
chosen decode worker pulls it (`push`), which sends it over that decode worker's channel. With
speculative.draft_kv "ship" the engine's draft model computes the prompt's draft KV in the
loop's next turn (the first token is answered first), and it goes over the same channel with
the target's (kv_transfer.channel). Plain
class over worker.base.EngineWorker (engine, loop, publisher, health): the Ray actor in
actor.py only adapts its futures to asyncio.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

from engine import EngineConfig, KVExport, RequestOutput, Role
from engine.messages import Aborted, GenerateRequest, PrefillResult
from kv_transfer import KVLayout, KVTransferError, SenderChannel, TransferConfig, connect
from kv_transfer.layout import draft_layout
from kv_transfer.leases import LeaseSweeper
from kv_transfer.reshard import ShardedSender, connect_group
from worker.base import EngineWorker, PublisherFactory

log = logging.getLogger(__name__)


class PrefillWorker(EngineWorker):
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 publisher: PublisherFactory | None = None):
        """`publisher`: its lease and cache events in Redis, when the cluster has an index."""
        super().__init__(worker_id, engine_cfg.model_copy(update={"role": Role.PREFILL}), publisher)
        self.layout = KVLayout.of_model(self.engine.model_id, self.engine.runner.kv_cache,
                                        self.engine.model_config.num_kv_heads)
        self.draft_layout = draft_layout(self.engine)
        self.transfer_cfg = transfer_cfg
        self.channels: dict[str, SenderChannel | ShardedSender] = {}
        # One thread per channel: sends leave in the order decode workers pulled them.
        self.senders: dict[str, ThreadPoolExecutor] = {}
        # Prefilled requests' KV, copied out of the pool, until their decode worker pulls it.
        self.exports: dict[str, KVExport] = {}
        self.draft_exports: dict[str, Future] = {}  # their draft model's KV, when shipped: computed a turn later
        self.exported_at: dict[str, float] = {}
        # Prefills not yet answered: abort() must answer them, as the engine then reports nothing.
        self.pending: dict[str, Future[PrefillResult]] = {}
        self.sweeper = LeaseSweeper(self.drop_stale_exports, LeaseSweeper.interval_for(transfer_cfg.hold_timeout_s),
                                    f"{worker_id}-leases")

    def connect(self, decode_id: str, address: tuple[str, int] | list[tuple[str, int]], ticket: str) -> None:
        """Join decode worker `decode_id`'s transfer server under `ticket`, the one the router
        handed that worker's accept() (blocks until it accepts). A list of
        addresses is a tensor-parallel decode worker, one per rank: each rank gets its own pair
        and, per request, exactly its KV heads (kv_transfer.reshard). Replaces an existing pair
        with that worker (the router rebuilds a pair whose link failed)."""
        self.disconnect(decode_id)
        if isinstance(address, list):
            self.channels[decode_id] = connect_group(address, self.layout, self.transfer_cfg, self.worker_id,
                                                     ticket)
        else:
            self.channels[decode_id] = connect(address, self.layout, self.transfer_cfg, name=self.worker_id,
                                              ticket=ticket)
            self.channels[decode_id].draft_layout = self.draft_layout
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
            self.draft_exports.pop(rid, None)
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
                    self.engine.release(req.request_id)  # hands its blocks back; nobody will pull it
                return
            if out.kv_ready:
                # Copy the KV out now, in the same loop turn: a later pull then waits for no
                # engine step, and the blocks go back to the pool (full ones stay cached).
                self.exports[req.request_id] = self.engine.export_kv(req.request_id, draft=False)
                self.exported_at[req.request_id] = time.monotonic()
                if self.engine.draft_kv is not None:
                    # The draft's KV in the loop's next turn: the first token is answered first, and
                    # the push waits for this (the decode worker is still being asked to pull).
                    rid = req.request_id
                    self.draft_exports[rid] = self.loop.call(lambda engine: engine.export_draft_kv(rid))
            result.set_result(PrefillResult(
                req.request_id, out.new_token_ids[0], out.new_text, out.finished, out.finish_reason, out.usage,
                out.logprobs[-1] if out.logprobs else None, queue_s=0.0, prefill_s=time.monotonic() - start))

        # the door checked the request when it built it: the engine checks only what needs its pool
        added = self.loop.add_request(req.request_id, req.prompt_token_ids, req.params, sink, req.cache_salt,
                                      checked=True)
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
        draft = self.draft_exports.pop(request_id, None)
        if export is None:
            return False

        def send() -> None:
            draft_kv = export.draft_kv
            if draft is not None:
                try:
                    draft_kv = draft.result(timeout=self.transfer_cfg.timeout_s)
                except Exception as exc:  # the target's KV still goes; the decode side's draft recomputes
                    log.warning("the draft KV of %s was not computed: %s", request_id, exc)
            try:
                channel.send(export.request_id, export.kv, export.num_tokens, draft_kv=draft_kv)
            except KVTransferError as exc:  # the receiving side sees it too and recovers
                log.warning("sending KV of %s to %s failed: %s", request_id, decode_id, exc)

        self.senders[decode_id].submit(send)
        return True

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id).result()
        self.exports.pop(request_id, None)
        self.draft_exports.pop(request_id, None)
        self.exported_at.pop(request_id, None)
        # The loop no longer calls this request's sink, so nothing else will answer its caller.
        pending = self.pending.pop(request_id, None)
        if pending is not None and not pending.done():
            pending.set_exception(Aborted(f"request {request_id!r} was aborted during prefill"))

    def corrupt_next_payload(self, decode_id: str, draft: bool = False) -> None:
        """Test hook: flip one byte of the next payload sent to `decode_id` (the draft's KV when `draft`)."""
        if draft:
            self.channels[decode_id].corrupt_next_draft_payload = True
        else:
            self.channels[decode_id].corrupt_next_payload = True

    def broken_pairs(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if ch.broken)

    def peers(self) -> list[str]:
        return sorted(peer for peer, ch in list(self.channels.items()) if not ch.broken)

    def stats(self) -> dict:
        return super().stats() | {"channels": sorted(self.channels), "pinned_exports": len(self.exports)}

    def close(self) -> None:
        self.sweeper.stop()
        for decode_id in list(self.channels):
            self.disconnect(decode_id)
        self.close_engine()
