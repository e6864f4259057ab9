"""Per-request latencies and the run summary, with `vllm bench serve`'s definitions and field names.

- TTFT: from sending the request to the first chunk that carries a token.
- ITL: the gaps between consecutive token-carrying chunks (one per gap, pooled over requests).
- TPOT: (e2e - TTFT) / (output tokens - 1), per request, so the first token is excluded;
  requests with one output token have none.
- E2EL: from sending to the end of the stream.
- Goodput: completed requests per second that met every SLO given (failed ones never do).
Throughputs count completed requests over the run's duration (first send to last answer).
Percentiles interpolate linearly (numpy's default, as vLLM).
"""
from __future__ import annotations

import re
from collections import Counter

import numpy as np

from loadtest.records import RequestRecord, meets_slo

LATENCIES = ("ttft", "tpot", "itl", "e2el")
STATS = ("mean", "median", "std", "p50", "p90", "p99")
SLO_KEYS = ("ttft", "tpot", "itl", "e2el")


def itls(record: RequestRecord) -> list[float]:
    return record.itls_s


def tpot(record: RequestRecord) -> float | None:
    return record.tpot_s


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft=200ms,tpot=50ms,e2el=2s' -> {"ttft": 0.2, "tpot": 0.05, "e2el": 2.0} (seconds;
    a bare number is milliseconds, as in vLLM's --goodput)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        m = re.fullmatch(r"(\w+)\s*[=:]\s*(\d+(?:\.\d*)?)\s*(ms|s)?", part)
        if not m or m[1] not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: use KEY=VALUE[ms|s] with KEY one of {', '.join(SLO_KEYS)}, "
                             "e.g. ttft=200ms,tpot=50ms")
        slo[m[1]] = float(m[2]) / (1 if m[3] == "s" else 1000)
    return slo


def _stats(values_s: list[float], name: str) -> dict[str, float | None]:
    ms = np.asarray(values_s, dtype=float) * 1000
    if not ms.size:
        return {f"{s}_{name}_ms": None for s in STATS}
    return {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
            f"std_{name}_ms": float(ms.std()), **{f"p{p}_{name}_ms": float(np.percentile(ms, p))
                                                  for p in (50, 90, 99)}}


def _latencies(done: list[RequestRecord]) -> dict[str, list[float]]:
    """Each latency's samples over the completed requests, in seconds (ITL pooled over requests)."""
    return {"ttft": [r.ttft_s for r in done if r.ttft_s is not None],
            "tpot": [t for r in done if (t := r.tpot_s) is not None],
            "itl": [gap for r in done for gap in r.itls_s],
            "e2el": [r.e2e_s for r in done if r.e2e_s is not None]}


def _counts(records: list[RequestRecord], done: list[RequestRecord], duration_s: float,
            slo: dict[str, float] | None) -> dict:
    failed = [r for r in records if not r.ok]
    per_s = 1 / duration_s if duration_s > 0 else 0.0
    n_in = sum(r.prompt_tokens for r in done)
    n_out = sum(r.output_tokens for r in done)
    n_cached = sum(r.cached_tokens for r in done)
    return {
        "duration": duration_s,
        "num_prompts": len(records),
        "completed": len(done),
        "failed": len(failed),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "total_cached_tokens": n_cached,
        "request_throughput": len(done) * per_s,
        "request_goodput": sum(meets_slo(r, slo) for r in done) * per_s if slo else None,
        "input_throughput": n_in * per_s,
        "output_throughput": n_out * per_s,
        "total_token_throughput": (n_in + n_out) * per_s,
        "cache_hit_ratio": n_cached / n_in if n_in else 0.0,
        "error_rate": len(failed) / len(records) if records else 0.0,
        "errors_by_kind": dict(Counter(r.error_kind for r in failed)),
        "slo": {f"{k}_ms": v * 1000 for k, v in (slo or {}).items()},
    }


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """The run's summary; keys match `vllm bench serve`'s result where the meaning does."""
    done = [r for r in records if r.ok]
    summary = _counts(records, done, duration_s, slo)
    for name, values in _latencies(done).items():
        summary.update(_stats(values, name))
    return summary
