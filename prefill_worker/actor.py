"""Ray actor shim over PrefillWorker: adapts its futures and blocking calls to asyncio."""
from __future__ import annotations

import asyncio

import ray

from engine import EngineConfig
from engine.messages import GenerateRequest, KVHandle, PrefillResult
from kv_transfer import TransferConfig
from prefill_worker.worker import PrefillWorker
from worker.base import PublisherFactory, WorkerActor


@ray.remote
class PrefillActor(WorkerActor):
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 publisher: PublisherFactory | None = None):
        transfer_cfg = transfer_cfg.on_node(ray.util.get_node_ip_address())
        self._serve(PrefillWorker(worker_id, engine_cfg, transfer_cfg, publisher))

    async def prefill(self, req: GenerateRequest, handle: KVHandle | None = None) -> PrefillResult:
        return await asyncio.wrap_future(self.worker.prefill(req, handle))

    async def connect(self, decode_id: str, address: tuple[str, int], ticket: str) -> None:
        await asyncio.to_thread(self.worker.connect, decode_id, address, ticket)

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.worker.abort, request_id)

    async def corrupt_next_payload(self, decode_id: str) -> None:
        self.worker.corrupt_next_payload(decode_id)

    async def disconnect(self, decode_id: str) -> None:
        """Close the pair with a decode worker that left the cluster."""
        await asyncio.to_thread(self.worker.disconnect, decode_id)
