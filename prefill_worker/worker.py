"""A prefill worker: an engine in prefill role whose requests end at their first token.

A request comes with the KVHandle of the decode worker that reserved blocks for it; in the
loop turn its first token exists its KV is copied out of the pool and queued for that decode
worker (kv_transfer.prefill_side), so the transfer starts while the first token travels to the
client and nobody has to ask for it. With speculative.draft_kv "ship" the engine's draft model
computes the prompt's draft KV in the loop's next turn (the first token is answered first), and
it goes over the same channel with the target's (kv_transfer.channel). Plain class over
worker.base.EngineWorker (engine, loop, publisher, health): the Ray actor in actor.py only
adapts its futures to asyncio.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future

from engine import EngineConfig, RequestOutput, Role
from engine.messages import Aborted, GenerateRequest, KVHandle, PrefillResult
from kv_transfer import KVLayout, TransferConfig
from kv_transfer.layout import draft_layout
from kv_transfer.leases import LeaseSweeper
from kv_transfer.prefill_side import PrefillConnector
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
        self.kv = PrefillConnector(worker_id, transfer_cfg, self.layout, self.draft_layout)
        # Prefills not yet answered: abort() must answer them, as the engine then reports nothing.
        self.pending: dict[str, Future[PrefillResult]] = {}
        self.sweeper = LeaseSweeper(self.drop_stale_exports, LeaseSweeper.interval_for(transfer_cfg.hold_timeout_s),
                                    f"{worker_id}-leases")

    @property
    def channels(self) -> dict:
        return self.kv.channels

    def connect(self, decode_id: str, address: tuple[str, int] | list[tuple[str, int]], ticket: str) -> None:
        """Pair with decode worker `decode_id` under the router's `ticket` (PrefillConnector.connect)."""
        self.kv.connect(decode_id, address, ticket)

    def disconnect(self, decode_id: str) -> None:
        self.kv.disconnect(decode_id)

    def drop_stale_exports(self) -> list[str]:
        """Forget exports whose send did not start within transfer.hold_timeout_s."""
        stale = self.kv.take_stale()
        for rid in stale:
            log.warning("dropped the KV of %s: it was never sent", rid)
        return stale

    def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> Future[PrefillResult]:
        """Compute the prompt; with `handle` its KV goes to that decode worker as soon as it is
        exported (without, nobody takes it: its blocks go back to the pool at once)."""
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
            sent = False
            if out.kv_ready:
                if result.done() or handle is None or not self.kv.can_send(handle.decode_id):
                    # aborted before the engine had it (abort raced add_request), or nowhere to send
                    self.engine.release(req.request_id)  # hands its blocks back
                else:
                    sent = self._export(req.request_id, handle)
            if result.done():
                return
            result.set_result(PrefillResult(
                req.request_id, out.new_token_ids[0], out.new_text, out.finished, out.finish_reason, out.usage,
                out.logprobs[-1] if out.logprobs else None, queue_s=0.0, prefill_s=time.monotonic() - start,
                kv_sent=sent))

        # the door checked the request when it built it: the engine checks only what needs its pool
        added = self.loop.add_request(req.request_id, req.prompt_token_ids, req.params, sink, req.cache_salt,
                                      checked=True)
        added.add_done_callback(lambda f: f.exception() is not None and not result.done()
                                and result.set_exception(f.exception()))
        return result

    def _export(self, rid: str, handle: KVHandle) -> bool:
        """Copy the KV out now, in the same loop turn (the blocks go back to the pool, full ones
        stay cached), and queue it for the handle's decode worker."""
        export = self.engine.export_kv(rid, draft=False)
        draft = None
        if self.engine.draft_kv is not None:
            # The draft's KV in the loop's next turn: the first token is answered first, and the
            # send waits for it.
            draft = self.loop.call(lambda engine: engine.export_draft_kv(rid))
        return self.kv.send(handle, export, draft)

    def abort(self, request_id: str) -> None:
        self.loop.abort(request_id).result()
        self.kv.abort(request_id)
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
        return super().stats() | {"channels": sorted(self.channels), "pinned_exports": len(self.kv.outgoing)}

    def close(self) -> None:
        self.sweeper.stop()
        self.kv.close()
        self.close_engine()
