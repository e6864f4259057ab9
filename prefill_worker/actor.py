"""Ray actor shim over PrefillWorker: adapts its futures and blocking calls to asyncio."""
from __future__ import annotations

import asyncio

import ray

from engine import EngineConfig
from engine.faults import FaultInjector
from kv_transfer import TransferConfig
from prefill_worker.worker import PrefillWorker
from router.config import IndexLink
from router.types import GenerateRequest, PrefillResult


@ray.remote
class PrefillActor:
    def __init__(self, worker_id: str, engine_cfg: EngineConfig, transfer_cfg: TransferConfig,
                 index: IndexLink | None = None):
        transfer_cfg = transfer_cfg.on_node(ray.util.get_node_ip_address())
        self.worker = PrefillWorker(worker_id, engine_cfg, transfer_cfg, index)
        self.faults = FaultInjector.from_env(self.worker.loop)  # chaos tests only

    async def prefill(self, req: GenerateRequest) -> PrefillResult:
        return await asyncio.wrap_future(self.worker.prefill(req))

    async def connect(self, decode_id: str, address: tuple[str, int]) -> None:
        await asyncio.to_thread(self.worker.connect, decode_id, address)

    async def push(self, request_id: str, decode_id: str) -> bool:
        return await asyncio.to_thread(self.worker.push, request_id, decode_id)

    async def abort(self, request_id: str) -> None:
        await asyncio.to_thread(self.worker.abort, request_id)

    async def corrupt_next_payload(self, decode_id: str) -> None:
        self.worker.corrupt_next_payload(decode_id)

    async def inject_fault(self, kind: str) -> None:
        """Chaos tests only: refused unless the worker started with BRIGADE_FAULT_INJECTION=1 (engine/faults.py)."""
        self.faults.inject(kind)

    async def health(self) -> dict:
        return self.worker.health()

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.worker.stats)

    async def disconnect(self, decode_id: str) -> None:
        """Close the pair with a decode worker that left the cluster."""
        await asyncio.to_thread(self.worker.disconnect, decode_id)

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.worker.close)
