"""Fault injection, for the chaos suite only (tests/chaos/): make a live worker's engine fail on
purpose, so that the real failure path runs (the loop dies, the worker reports not alive, the
router ejects it, the supervisor replaces it) while the worker's process and actor live on.

Off unless the worker's process has BRIGADE_FAULT_INJECTION=1 when the worker starts (a local
Ray's workers inherit the environment of the process that started Ray, e.g. `brigade serve`);
otherwise every injection is refused. Kinds:

- "engine_crash": the engine's next step raises (at once, even when it is idle).
"""
from __future__ import annotations

import os

from engine.engine_loop import EngineLoop

ENV = "BRIGADE_FAULT_INJECTION"
KINDS = ("engine_crash",)


class FaultInjectionOff(RuntimeError):
    """An injection asked of a worker started without BRIGADE_FAULT_INJECTION=1."""


class InjectedFault(RuntimeError):
    """What an injected engine crash raises (so logs say it was on purpose)."""


class FaultInjector:
    def __init__(self, loop: EngineLoop, enabled: bool):
        self.loop, self.enabled = loop, enabled

    @classmethod
    def from_env(cls, loop: EngineLoop) -> FaultInjector:
        return cls(loop, os.environ.get(ENV) == "1")

    def inject(self, kind: str) -> None:
        if not self.enabled:
            raise FaultInjectionOff(f"fault injection is off in this worker: it is for chaos tests, and needs {ENV}=1 "
                                    "in the environment of the process that starts the workers")
        if kind not in KINDS:
            raise ValueError(f"kind: unknown fault {kind!r}; one of {', '.join(KINDS)}")
        self.loop.fail_next_step(InjectedFault(f"{kind} injected by a chaos test"))
