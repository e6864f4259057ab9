"""loadtest.metrics on synthetic request timelines whose answers are worked out by hand."""
from __future__ import annotations

import pytest

from loadtest.metrics import itls, meets_slo, parse_slo, summarize, tpot
from loadtest.types import RequestRecord


def record(rid: str, chunk_times: list[float], e2e: float, output_tokens: int | None = None, prompt: int = 100,
           cached: int = 0) -> RequestRecord:
    return RequestRecord(rid, rid, 0, start_s=0.0, prompt_tokens=prompt, cached_tokens=cached,
                         output_tokens=len(chunk_times) if output_tokens is None else output_tokens,
                         ttft_s=chunk_times[0], e2e_s=e2e, chunk_times_s=chunk_times,
                         chunk_tokens=[1] * len(chunk_times))


def failed(rid: str, kind: str) -> RequestRecord:
    return RequestRecord(rid, rid, 0, start_s=0.0, prompt_tokens=100, e2e_s=0.01, error_kind=kind, error="x")


# A: 4 tokens, TTFT 100 ms, gaps 50/100/50 ms, end at 320 ms -> TPOT (320 - 100) / 3 ms.
A = record("a", [0.10, 0.15, 0.25, 0.30], e2e=0.32, cached=60)
# B: one token at 500 ms: no ITL, no TPOT.
B = record("b", [0.50], e2e=0.50, prompt=50)


def test_itl_is_the_gap_between_chunk_timestamps() -> None:
    assert itls(A) == pytest.approx([0.05, 0.10, 0.05])
    assert itls(B) == []


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(A) == pytest.approx(0.22 / 3)
    slow_start = record("s", [1.0, 1.01, 1.02, 1.03], e2e=1.03)  # a long TTFT must not leak into TPOT
    assert tpot(slow_start) == pytest.approx(0.01)
    assert tpot(B) is None  # one output token: nothing after the first
    assert tpot(failed("f", "timeout")) is None


def test_summary_counts_throughputs_and_percentiles() -> None:
    s = summarize([A, B, failed("f1", "http_503"), failed("f2", "http_503"), failed("f3", "timeout")],
                  duration_s=2.0)
    assert (s["num_prompts"], s["completed"], s["failed"]) == (5, 2, 3)
    assert s["errors_by_kind"] == {"http_503": 2, "timeout": 1}
    assert s["error_rate"] == pytest.approx(0.6)
    assert s["total_input_tokens"] == 150 and s["total_output_tokens"] == 5  # completed requests only
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(2.5)
    assert s["input_throughput"] == pytest.approx(75.0)
    assert s["total_token_throughput"] == pytest.approx(77.5)
    assert s["cache_hit_ratio"] == pytest.approx(60 / 150)
    # TTFTs 100 and 500 ms: linear interpolation between them.
    assert s["mean_ttft_ms"] == pytest.approx(300) and s["median_ttft_ms"] == pytest.approx(300)
    assert s["p90_ttft_ms"] == pytest.approx(460) and s["p99_ttft_ms"] == pytest.approx(496)
    assert s["std_ttft_ms"] == pytest.approx(200)
    # ITLs pooled: 50, 100, 50 ms; TPOT only from A.
    assert s["mean_itl_ms"] == pytest.approx(200 / 3) and s["median_itl_ms"] == pytest.approx(50)
    assert s["p99_itl_ms"] == pytest.approx(99)
    assert s["mean_tpot_ms"] == pytest.approx(220 / 3) and s["p99_tpot_ms"] == pytest.approx(220 / 3)
    assert s["median_e2el_ms"] == pytest.approx(410)
    assert s["request_goodput"] is None  # no SLO given


def test_summary_uses_vllm_bench_serve_field_names() -> None:
    s = summarize([A], duration_s=1.0)
    vllm_keys = {"duration", "completed", "total_input_tokens", "total_output_tokens", "request_throughput",
                 "request_goodput", "output_throughput", "total_token_throughput"}
    vllm_keys |= {f"{stat}_{m}_ms" for stat in ("mean", "median", "std", "p99")
                  for m in ("ttft", "tpot", "itl", "e2el")}
    assert vllm_keys <= s.keys()


def test_goodput_counts_requests_meeting_every_slo() -> None:
    records = [A, B, failed("f", "timeout")]
    assert summarize(records, 2.0, parse_slo("ttft=200ms"))["request_goodput"] == pytest.approx(0.5)  # A only
    # TPOT 73 ms misses 50 ms; B has no TPOT (one token) and so meets it, as in vLLM.
    assert summarize(records, 2.0, parse_slo("tpot=50ms"))["request_goodput"] == pytest.approx(0.5)
    assert summarize(records, 2.0, parse_slo("ttft=1s,tpot=80ms"))["request_goodput"] == pytest.approx(1.0)
    assert summarize(records, 2.0, parse_slo("ttft=200ms,tpot=50ms"))["request_goodput"] == 0.0
    assert meets_slo(A, parse_slo("itl=100ms")) and not meets_slo(A, parse_slo("itl=99ms"))  # every gap counts
    assert not meets_slo(failed("f", "timeout"), {})


def test_slo_parsing_units_and_errors() -> None:
    assert parse_slo("ttft=200ms, tpot=0.05s,e2el=2000") == pytest.approx({"ttft": 0.2, "tpot": 0.05, "e2el": 2.0})
    assert parse_slo(None) == {} and parse_slo("") == {}
    with pytest.raises(ValueError, match="bad SLO 'latency=1s'.*ttft, tpot, itl, e2el"):
        parse_slo("latency=1s")
    with pytest.raises(ValueError, match="bad SLO 'ttft=fast'"):
        parse_slo("ttft=fast")


def test_empty_run_has_no_latencies_rather_than_zeros() -> None:
    s = summarize([failed("f", "connection")], duration_s=1.0, slo=parse_slo("ttft=1s"))
    assert s["completed"] == 0 and s["request_goodput"] == 0.0 and s["p99_ttft_ms"] is None
