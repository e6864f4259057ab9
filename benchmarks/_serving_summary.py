"""serving_bench.sh's last step (a helper, not a benchmark): the two modes' result.json files ->
benchmarks/results/<name>.json in the benchmarks' shape, with disaggregated / colocated ratios at
the highest offered rate and every rate's headline figures (goodput at the SLO, p99 TTFT, p99 ITL).

usage: python benchmarks/_serving_summary.py NAME OUT_DIR [MODEL]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks._common import machine_info, print_ratios, write_result

HEADLINE = ("request_throughput", "request_goodput", "output_throughput", "p99_ttft_ms", "median_ttft_ms",
            "p99_itl_ms", "median_tpot_ms", "cache_hit_ratio", "error_rate")
TARGETS = {"goodput_disagg_vs_colocated": ">= 1.0", "p99_itl_disagg_vs_colocated": "<= 1.0"}


def main(name: str, out: Path, model: str | None = None) -> None:
    modes = {m: json.loads((out / m / "result.json").read_text()) for m in ("disaggregated", "colocated")}
    raw = {"model": model, "slo": modes["disaggregated"]["runs"][0]["slo"],
           "config": modes["disaggregated"]["config"],
           **{m: [{"request_rate": str(run["request_rate"]), **{k: run[k] for k in HEADLINE}} for run in doc["runs"]]
              for m, doc in modes.items()}}
    top = {m: max(doc["runs"], key=lambda run: run["request_rate"]) for m, doc in modes.items()}

    def ratio(key: str) -> float | None:
        a, b = top["disaggregated"].get(key), top["colocated"].get(key)
        return a / b if a is not None and b else None

    ratios = {"goodput_disagg_vs_colocated": ratio("request_goodput"),
              "p99_ttft_disagg_vs_colocated": ratio("p99_ttft_ms"),
              "p99_itl_disagg_vs_colocated": ratio("p99_itl_ms"),
              "throughput_disagg_vs_colocated": ratio("request_throughput")}
    path = write_result(name, machine_info(), ratios, TARGETS, raw)
    print_ratios(ratios, TARGETS, title=f"{name}: disaggregated / colocated at the highest rate")
    for mode, rows in ((m, raw[m]) for m in modes):
        for row in rows:
            print(f"{mode:>13} rate {row['request_rate']}: goodput {row['request_goodput']:.2f} req/s, "
                  f"p99 TTFT {row['p99_ttft_ms']:.0f} ms, p99 ITL {row['p99_itl_ms']:.1f} ms")
    print(f"wrote {path}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else None)
