"""What one disaggregated request costs in Ray calls: the door's call to the router, then the
router's reserve, prefill and generate through RayWorker (counted here over fake actor handles
that record every `.remote`), and no call from one worker to another (the prefill worker sends
the KV it exported to the decode worker of the reservation's handle over their pair)."""
from __future__ import annotations

import ast
import asyncio
from collections import Counter
from pathlib import Path

from worker_fakes import router_over

from engine.messages import Chunk, GenerateRequest, KVHandle, PrefillResult
from engine.outputs import Usage
from engine.sampling import SamplingParams
from router.config import RouterConfig
from router.workers import RayWorker

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [5, 6, 7, 8]


class _Method:
    def __init__(self, handle: FakeActor, name: str):
        self.handle, self.name = handle, name

    def remote(self, *args):
        self.handle.calls[self.name] += 1
        return getattr(self.handle, "on_" + self.name)(*args)


class FakeActor:
    """Stands for a worker's Ray actor handle: `handle.NAME.remote(...)` counts the call and runs on_NAME."""

    def __init__(self):
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> _Method:
        if name.startswith(("_", "on_")) or name == "calls":
            raise AttributeError(name)
        return _Method(self, name)


class PrefillActor(FakeActor):
    def __init__(self):
        super().__init__()
        self.handles: list[KVHandle | None] = []

    async def on_prefill(self, req: GenerateRequest, handle: KVHandle | None) -> PrefillResult:
        self.handles.append(handle)
        return PrefillResult(req.request_id, 9, "x", False, None, Usage(len(PROMPT), 1, 0), None, 0.0, 0.01,
                             kv_sent=True)


class DecodeActor(FakeActor):
    async def on_reserve(self, request_id: str, num_tokens: int, prefill_id: str) -> KVHandle:
        return KVHandle(request_id, prefill_id, "decode-0", num_tokens)

    async def on_generate(self, req: GenerateRequest, first: PrefillResult, handle: KVHandle):
        for i in range(1, req.params.max_tokens):
            last = i == req.params.max_tokens - 1
            yield _ready(Chunk(req.request_id, [i], "y", last, "length" if last else None))


def _ready(value):
    f = asyncio.get_running_loop().create_future()
    f.set_result(value)
    return f


def test_a_disaggregated_request_costs_the_router_three_worker_calls():
    prefill_actor, decode_actor = PrefillActor(), DecodeActor()
    prefill, decode = RayWorker("prefill-0", "prefill", prefill_actor), RayWorker("decode-0", "decode", decode_actor)
    router = router_over(RouterConfig(policy="round_robin"), prefill, decode, colocated=False,
                         peers={"prefill-0": {"decode-0"}, "decode-0": {"prefill-0"}})

    async def main() -> list[Chunk]:
        req = GenerateRequest("r", PROMPT, SamplingParams(max_tokens=4, temperature=0.0))
        return [c async for c in router.generate(req)]

    chunks = asyncio.run(main())
    assert chunks[-1].finished and [t for c in chunks for t in c.token_ids] == [9, 1, 2, 3]
    calls = prefill_actor.calls + decode_actor.calls
    print(f"\nRay calls per disaggregated request: 1 (door -> router) + {sum(calls.values())} ({dict(calls)})")
    assert calls == Counter(reserve=1, prefill=1, generate=1)  # + the door's call to the router: 4
    assert prefill_actor.handles == [KVHandle("r", "prefill-0", "decode-0", len(PROMPT))]


def _remote_calls(path: Path) -> list[str]:
    """`X.method.remote(...)` call sites in `path`, as "X.method"."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "remote"
                and isinstance(node.func.value, ast.Attribute)):
            out.append(ast.unparse(node.func.value))
    return out


def test_no_worker_actor_calls_another_worker():
    """A worker actor's only `.remote` calls go to the ranks of its own tensor-parallel group."""
    sites = {str(p.relative_to(ROOT)): _remote_calls(p)
             for p in [*(ROOT / "prefill_worker").glob("*.py"), ROOT / "decode_worker" / "actor.py",
                       ROOT / "decode_worker" / "worker.py"]}
    assert {f: calls for f, calls in sites.items() if any(not c.startswith("r.") for c in calls)} == {}
    assert sites["decode_worker/actor.py"]  # the rank fan-out is seen, so the check reads real call sites
