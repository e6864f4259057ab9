"""The actor processes of the Ray this test process started (its descendants: never another Ray
on the same machine, such as a parallel test run's)."""
from __future__ import annotations

import psutil

ACTOR_CLASSES = ("PrefillActor", "DecodeActor", "RouterActor")


def actor_processes(classes: tuple[str, ...] = ACTOR_CLASSES) -> dict[int, str]:
    """pid -> actor class, for the live actor processes of those classes, found by Ray's
    process title ("ray::DecodeActor...")."""
    found = {}
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:  # gone meanwhile
            continue
        cls = next((c for c in classes if title.startswith(f"ray::{c}")), None)
        if cls is not None:
            found[p.pid] = cls
    return found
