"""Where the simulator meets `brigade bench` (composed here: sim/ may not import loadtest):
loadtest's workloads and arrival processes as simulated sessions, and a simulated run as a
bench result document, so `brigade bench compare` and `report` read it."""
from __future__ import annotations

import dataclasses
import time

from loadtest.arrivals import arrival_offsets
from loadtest.metrics import summarize
from loadtest.types import RequestRecord
from loadtest.workloads import WorkloadConfig, build_sessions
from sim.fleet import SimSession


def from_loadtest(cfg: WorkloadConfig, rate: float, arrival: str = "poisson", burstiness: float = 1.0
                  ) -> list[SimSession]:
    """The workload's sessions at `rate` sessions/s, as `brigade bench run` would send them
    (token-id prompts: the simulator has no tokenizer)."""
    if cfg.prompt_format != "ids":
        raise ValueError("the simulator replays token-id prompts: use --prompt-format ids")
    sessions = build_sessions(cfg)
    offsets = arrival_offsets(sessions, rate, arrival, burstiness, cfg.seed)
    return [SimSession(s.id, off, tuple((t.content, t.output_len) for t in s.turns), s.system, s.think_time_s)
            for s, off in zip(sessions, offsets)]


def bench_result(run: dict, slo: dict[str, float] | None, label: str | None, workload: str,
                 rate: float | None) -> dict:
    """A simulated run (sim.fleet.simulate) as `brigade bench`'s result document."""
    fields = {f.name for f in dataclasses.fields(RequestRecord)}
    records = [RequestRecord(**{k: v for k, v in dataclasses.asdict(r).items() if k in fields}) for r in run["records"]]
    fleet = run["fleet"]
    summary = {"request_rate": rate if rate is not None else float("inf"), "burstiness": None,
               "max_concurrency": None, "seed": 0, **summarize(records, run["duration"], slo),
               "records": records, "sim": run["sim"]}
    return {"brigade_bench": 1, "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
            "label": label or f"sim {fleet['mode']} {fleet['prefill']}P{fleet['decode']}D {fleet['device']}",
            "backend": "sim", "url": f"sim://{fleet['device']}/{fleet['model']}", "endpoint": "completions",
            "model_id": fleet["model"], "workload": workload, "config": {"fleet": fleet}, "runs": [summary]}
