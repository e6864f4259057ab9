"""What the server's engine steps took while a run ran: Brigade's /metrics counts every worker's
steps by kind ("prompt" or "decode") and batch (decoding sequences in the step), with their
wall and CPU seconds (engine/step_log.py). Read before and after a run, their difference says
whether a slow run's workers stepped slowly (a busy or slower machine) or queued (more load),
next to a simulated run's own record (`brigade sim`). Servers without these series (vLLM, a
Brigade gRPC door with no HTTP beside it) give None and the run records nothing.
"""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

SERIES = {"brigade_engine_steps_total": "steps", "brigade_engine_step_seconds_total": "wall_s",
          "brigade_engine_step_cpu_seconds_total": "cpu_s"}


def parse(text: str) -> dict | None:
    """{worker: {kind: {batch: {"steps", "wall_s", "cpu_s"}}}} from Prometheus text ({} before
    any step); None if the server does not count steps."""
    out: dict = {}
    counted = False
    for family in text_string_to_metric_families(text):
        counted = counted or f"{family.name}_total" in SERIES
        for sample in family.samples:
            field = SERIES.get(sample.name)
            if field is None:
                continue
            labels = sample.labels
            tally = out.setdefault(labels["worker"], {}).setdefault(labels["kind"], {}).setdefault(
                labels["batch"], {"steps": 0, "wall_s": 0.0, "cpu_s": 0.0})
            tally[field] = int(sample.value) if field == "steps" else sample.value
    return out if counted else None


def between(before: dict, after: dict) -> dict:
    """The steps in `after` that `before` had not counted yet, in the same nesting; tallies with
    no new step (and workers, kinds with none) are left out."""
    out: dict = {}
    for key, now in after.items():
        then = before.get(key, {})
        if "steps" in now:
            steps = now["steps"] - then.get("steps", 0)
            if steps > 0:
                out[key] = {"steps": steps, "wall_s": now["wall_s"] - then.get("wall_s", 0.0),
                            "cpu_s": now["cpu_s"] - then.get("cpu_s", 0.0)}
        elif inner := between(then, now):
            out[key] = inner
    return out


def mean_step_ms(steps: dict, kind: str = "decode") -> dict[str, dict]:
    """Per batch label, over every worker: {"steps", "wall_ms", "cpu_ms"} means of `kind`'s steps."""
    totals: dict[str, dict] = {}
    for kinds in steps.values():
        for batch, t in kinds.get(kind, {}).items():
            acc = totals.setdefault(batch, {"steps": 0, "wall_s": 0.0, "cpu_s": 0.0})
            for field in acc:
                acc[field] += t[field]
    return {batch: {"steps": t["steps"], "wall_ms": 1e3 * t["wall_s"] / t["steps"],
                    "cpu_ms": 1e3 * t["cpu_s"] / t["steps"]}
            for batch, t in sorted(totals.items(), key=lambda kv: int(kv[0]))}
