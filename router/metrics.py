"""Prometheus metrics for the front doors (one registry per server: no global state).

Both doors record the same series, labelled by `door` ("grpc" | "http"), so a dashboard
compares them side by side. The queue-depth gauges are what an autoscaler scales on.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class FrontDoorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("brigade_requests", "Requests answered, by door and outcome "
                                "(ok, invalid, unauthenticated, overloaded, unavailable, cancelled, deadline, error)",
                                ["door", "outcome"], registry=r)
        self.in_flight = Gauge("brigade_requests_in_flight", "Requests being served now", ["door"], registry=r)
        self.ttft = Histogram("brigade_time_to_first_token_seconds", "Arrival to first token",
                              ["door"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("brigade_request_duration_seconds", "Arrival to last token",
                             ["door"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("brigade_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("brigade_cached_prompt_tokens", "Prompt tokens served from a cache, by tier",
                                     ["tier"], registry=r)
        self.generated_tokens = Counter("brigade_generated_tokens", "Tokens generated", registry=r)
        # Speculative decoding: acceptance rate = accepted / draft; mean accepted per step = accepted / steps.
        self.spec_draft_tokens = Counter("brigade_spec_draft_tokens", "Tokens proposed by speculative decoding "
                                         "(finished requests)", registry=r)
        self.spec_accepted_tokens = Counter("brigade_spec_accepted_tokens", "Proposed tokens the target accepted",
                                            registry=r)
        self.spec_steps = Counter("brigade_spec_verify_steps", "Speculative verification steps", registry=r)
        self.spec_acceptance = Histogram("brigade_spec_acceptance_rate", "Per request: accepted / proposed tokens",
                                         buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0), registry=r)
        self.router_waiting = Gauge("brigade_router_waiting", "Requests waiting for admission at the router",
                                    registry=r)
        self.router_running = Gauge("brigade_router_running", "Requests dispatched to workers", registry=r)
        self.worker_steps = WorkerSteps()
        r.register(self.worker_steps)

    def finished(self, door: str, outcome: str, ttft_s: float | None = None, total_s: float | None = None,
                 usage=None) -> None:
        """Record one answered request; `usage` is an engine.outputs.Usage when it ran."""
        self.requests.labels(door, outcome).inc()
        if ttft_s is not None:
            self.ttft.labels(door).observe(ttft_s)
        if total_s is not None:
            self.e2e.labels(door).observe(total_s)
        if usage is not None:
            self.prompt_tokens.inc(usage.prompt_tokens)
            self.generated_tokens.inc(usage.completion_tokens)
            for tier, n in (usage.cached_by_tier or {}).items():
                self.cached_tokens.labels(tier).inc(n)
            if usage.spec_draft_tokens:
                self.spec_draft_tokens.inc(usage.spec_draft_tokens)
                self.spec_accepted_tokens.inc(usage.spec_accepted_tokens)
                self.spec_steps.inc(usage.spec_steps)
                self.spec_acceptance.observe(usage.spec_acceptance_rate)

    def set_router_queue(self, waiting: int, running: int) -> None:
        self.router_waiting.set(waiting)
        self.router_running.set(running)

    def set_worker_stats(self, stats: dict[str, dict]) -> None:
        """Each worker's engine counters (by worker id, as the router's stats() gives them), read
        at scrape time."""
        self.worker_steps.update(stats)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class WorkerSteps:
    """The workers' engine step counters (engine/step_log.py) as Prometheus counters labelled
    by worker, kind ("prompt" or "decode") and batch (decoding sequences in the step).
    mean step = rate(..._step_seconds_total) / rate(..._steps_total); seconds - cpu_seconds is
    the time the steps waited for a core (one torch thread per worker)."""

    SERIES = (("brigade_engine_steps", "Engine steps run", "steps"),
              ("brigade_engine_step_seconds", "Wall time of the engine's steps", "wall_s"),
              ("brigade_engine_step_cpu_seconds", "CPU time of the stepping thread in the engine's steps", "cpu_s"))

    def __init__(self) -> None:
        self._by_worker: dict[str, dict] = {}

    def update(self, stats: dict[str, dict]) -> None:
        """The workers in `stats` from now on: one that answered with new figures, one that did
        not with its last (a counter must not drop), none of a worker no longer listed."""
        self._by_worker = {worker_id: s["step_times"] if isinstance(s.get("step_times"), dict)
                           else self._by_worker.get(worker_id, {}) for worker_id, s in stats.items()}

    def collect(self):
        families = [CounterMetricFamily(name, doc, labels=["worker", "kind", "batch"]) for name, doc, _ in self.SERIES]
        for worker_id, kinds in sorted(self._by_worker.items()):
            for kind, batches in kinds.items():
                for batch, tally in batches.items():
                    for family, (_, _, field) in zip(families, self.SERIES):
                        family.add_metric([worker_id, kind, batch], tally[field])
        yield from families
