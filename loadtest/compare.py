"""`brigade bench compare A.json B.json`: the two runs side by side, rate by rate, with B / A."""
from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from loadtest.report import fmt

METRICS = [  # (summary key, label, higher is better)
    ("request_throughput", "req/s", True), ("request_goodput", "goodput req/s", True),
    ("output_throughput", "out tok/s", True), ("total_token_throughput", "total tok/s", True),
    ("mean_ttft_ms", "mean TTFT ms", False), ("median_ttft_ms", "p50 TTFT ms", False),
    ("p99_ttft_ms", "p99 TTFT ms", False), ("median_tpot_ms", "p50 TPOT ms", False),
    ("p99_tpot_ms", "p99 TPOT ms", False), ("median_itl_ms", "p50 ITL ms", False),
    ("p99_itl_ms", "p99 ITL ms", False), ("p99_e2el_ms", "p99 E2E ms", False),
    ("cache_hit_ratio", "cache hit ratio", True), ("error_rate", "error rate", False),
]


def ratio(a, b) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def pairs(a: dict, b: dict) -> list[tuple[dict, dict]]:
    """Runs matched by request rate; when the rates differ, in order."""
    by_rate = {run["request_rate"]: run for run in b["runs"]}
    if all(run["request_rate"] in by_rate for run in a["runs"]):
        return [(run, by_rate[run["request_rate"]]) for run in a["runs"]]
    return list(zip(a["runs"], b["runs"]))


def table(a: dict, b: dict, name_a: str, name_b: str) -> Table:
    t = Table(title=f"A = {name_a}   B = {name_b}")
    for col in ("rate", "metric", "A", "B", "B / A"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    for run_a, run_b in pairs(a, b):
        for key, label, higher_better in METRICS:
            r = ratio(run_a.get(key), run_b.get(key))
            better = r is not None and r != 1 and (r > 1) == higher_better
            style = "green" if better else "red" if r not in (None, 1) else ""
            shown = Text("-" if r is None else f"{r:.2f}x", style=style)
            t.add_row(fmt(run_a["request_rate"]), label, fmt(run_a.get(key), "{:.4g}"),
                      fmt(run_b.get(key), "{:.4g}"), shown)
        t.add_section()
    return t


def print_comparison(a: dict, b: dict, name_a: str, name_b: str, console: Console | None = None) -> None:
    (console or Console()).print(table(a, b, name_a, name_b))
