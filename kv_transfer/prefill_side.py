"""The prefill-side connector: the pairs a prefill worker sends over, and the exported KV of its
requests until it is on the wire.

Scheduler half: the worker exports a request's KV out of its engine in the loop turn its first
token exists (the blocks go back to the pool at once) and hands it to `send` with the request's
KVHandle; `abort` and `take_stale` drop an export not yet sent.

Wire half: one SenderChannel (or a ShardedSender for a tensor-parallel decode worker) per
decode worker, and one sending thread per channel, so sends leave in the order they were
exported, which is the order that decode worker's receiving thread takes them in. Nobody asks
for the KV: it goes as soon as it is exported, while the first token travels to the client.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from engine import KVExport
from engine.messages import KVHandle
from kv_transfer.channel import SenderChannel
from kv_transfer.config import TransferConfig
from kv_transfer.errors import KVTransferError
from kv_transfer.layout import KVLayout
from kv_transfer.rendezvous import connect
from kv_transfer.reshard import ShardedSender, connect_group

log = logging.getLogger(__name__)


@dataclass
class Outgoing:
    """An exported request's KV waiting for its channel's sending thread."""

    handle: KVHandle
    export: KVExport
    draft: Future | None  # the draft model's KV, computed a loop turn later (speculative "ship")
    exported_at: float = field(default_factory=time.monotonic)


class PrefillConnector:
    def __init__(self, worker_id: str, transfer_cfg: TransferConfig, layout: KVLayout,
                 draft_layout: KVLayout | None):
        self.worker_id, self.cfg, self.layout, self.draft_layout = worker_id, transfer_cfg, layout, draft_layout
        self.channels: dict[str, SenderChannel | ShardedSender] = {}  # by decode worker id
        self.senders: dict[str, ThreadPoolExecutor] = {}  # one thread per channel
        self.outgoing: dict[str, Outgoing] = {}  # by request id, until its send starts
        self._lock = threading.Lock()  # guards outgoing (the loop thread, senders, the sweep, abort)

    # -- scheduler half ------------------------------------------------------------------
    def can_send(self, decode_id: str) -> bool:
        channel = self.channels.get(decode_id)
        return channel is not None and not channel.broken

    def send(self, handle: KVHandle, export: KVExport, draft: Future | None = None) -> bool:
        """Queue `export` for the decode worker of `handle`; False (nothing queued) without a pair."""
        sender = self.senders.get(handle.decode_id)
        if sender is None or not self.can_send(handle.decode_id):
            return False
        with self._lock:
            self.outgoing[handle.request_id] = Outgoing(handle, export, draft)
        sender.submit(self._send, handle.request_id, handle.decode_id)
        return True

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.outgoing.pop(request_id, None)

    def take_stale(self) -> list[str]:
        """Drop exports whose send did not start within transfer.hold_timeout_s (their channel's
        thread was stuck behind a failing link); their ids."""
        deadline = time.monotonic() - self.cfg.hold_timeout_s
        with self._lock:
            stale = [rid for rid, out in self.outgoing.items() if out.exported_at < deadline]
            for rid in stale:
                del self.outgoing[rid]
        return stale

    # -- wire half -------------------------------------------------------------------------
    def connect(self, decode_id: str, address: tuple[str, int] | list[tuple[str, int]], ticket: str) -> None:
        """Join decode worker `decode_id`'s transfer server under `ticket`, the one the router
        handed that worker's accept() (blocks until it accepts). A list of addresses is a
        tensor-parallel decode worker, one per rank: each rank gets its own pair and, per
        request, exactly its KV heads (kv_transfer.reshard). Replaces an existing pair with
        that worker (the router rebuilds a pair whose link failed)."""
        self.disconnect(decode_id)
        if isinstance(address, list):
            channel = connect_group(address, self.layout, self.cfg, self.worker_id, ticket)
        else:
            channel = connect(address, self.layout, self.cfg, name=self.worker_id, ticket=ticket)
            channel.draft_layout = self.draft_layout
        self.channels[decode_id] = channel
        self.senders[decode_id] = ThreadPoolExecutor(1, thread_name_prefix=f"{self.worker_id}-to-{decode_id}")

    def disconnect(self, decode_id: str) -> None:
        channel = self.channels.pop(decode_id, None)
        if channel is not None:
            channel.close()
        sender = self.senders.pop(decode_id, None)
        if sender is not None:
            sender.shutdown(wait=False)

    def close(self) -> None:
        for decode_id in list(self.channels):
            self.disconnect(decode_id)

    def _send(self, request_id: str, decode_id: str) -> None:
        with self._lock:
            out = self.outgoing.pop(request_id, None)
        channel = self.channels.get(decode_id)
        if out is None or channel is None:  # aborted or stale meanwhile, or the pair left
            return
        draft_kv = out.export.draft_kv
        if out.draft is not None:
            try:
                draft_kv = out.draft.result(timeout=self.cfg.timeout_s)
            except Exception as exc:  # the target's KV still goes; the decode side's draft recomputes
                log.warning("the draft KV of %s was not computed: %s", request_id, exc)
        try:
            channel.send(request_id, out.export.kv, out.export.num_tokens, draft_kv=draft_kv)
        except KVTransferError as exc:  # the receiving side fails the hand-off too, and recomputes
            log.warning("sending KV of %s to %s failed: %s", request_id, decode_id, exc)
