"""The fault-injection hook (worker/faults.py) in one process: an injected engine crash kills the
loop by the path a real failed step takes, fails the request in flight and every later call with
EngineDied, and a worker started without BRIGADE_FAULT_INJECTION=1 refuses it."""
from __future__ import annotations

import queue

import pytest
from support import wait_for

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.engine_loop import EngineDied, EngineLoop
from worker.faults import FaultInjectionOff, FaultInjector, InjectedFault

pytestmark = pytest.mark.usefixtures("torch_single_thread")


@pytest.fixture
def loop():
    engine = LLMEngine(EngineConfig(model="tiny", dtype="float32", num_threads=1, cache=CacheConfig(num_blocks=256)))
    loop = EngineLoop(engine).start()
    yield loop
    loop.stop()


def test_injection_is_refused_unless_enabled(loop: EngineLoop, monkeypatch) -> None:
    monkeypatch.delenv("BRIGADE_FAULT_INJECTION", raising=False)
    with pytest.raises(FaultInjectionOff, match="BRIGADE_FAULT_INJECTION=1"):
        FaultInjector.from_env(loop).inject("engine_crash")
    with pytest.raises(ValueError, match="kind: unknown fault 'meteor'"):
        FaultInjector(loop, enabled=True).inject("meteor")
    assert loop.health()["alive"] and loop.call(lambda e: e.has_unfinished()).result(5) is False


def test_an_engine_crash_fails_the_request_in_flight_and_every_later_call(loop: EngineLoop) -> None:
    outputs: queue.Queue = queue.Queue()
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    loop.add_request("r0", [1, 2, 3], params, outputs.put).result(5)
    assert not isinstance(outputs.get(timeout=30), BaseException)  # it is running
    FaultInjector(loop, enabled=True).inject("engine_crash")
    while not isinstance(last := outputs.get(timeout=30), BaseException):
        pass
    assert isinstance(last, EngineDied) and isinstance(last.__cause__, InjectedFault)
    health = loop.health()
    assert health["alive"] is False and "engine_crash injected" in health["error"]
    with pytest.raises(EngineDied, match="engine_crash injected"):
        loop.call(lambda e: None).result(5)


def test_an_idle_engine_dies_at_once(loop: EngineLoop) -> None:
    FaultInjector(loop, enabled=True).inject("engine_crash")
    wait_for(lambda: not loop.alive, 10.0, "the engine loop stopped", interval_s=0.01)
    assert isinstance(loop.error, InjectedFault)


def test_the_router_takes_a_dead_engine_for_a_dead_worker() -> None:
    """So a request on it is migrated (or ends retriable), not failed as a bad request."""
    from ray.exceptions import RayTaskError

    from router.workers import worker_died

    died = EngineDied("engine failed: InjectedFault('engine_crash')")
    assert worker_died(RayTaskError("generate", "tb", died))
    assert worker_died(RayTaskError("generate", "tb", died).as_instanceof_cause())
    assert worker_died(RayTaskError("generate", "tb", RayTaskError("push", "tb", died)))
    assert not worker_died(RayTaskError("generate", "tb", ValueError("max_tokens: too many")))
    assert not worker_died(ValueError("max_tokens: too many"))
