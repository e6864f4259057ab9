"""The result document on disk (JSON) and the report a person reads (HTML with PNG figures).

result.json: run settings at the top level, then `runs`, one per request rate, each with the
summary (vLLM's field names where the meaning matches: request_throughput, request_goodput,
output_throughput, total_token_throughput, mean/median/std/p50/p90/p99_{ttft,tpot,itl,e2el}_ms,
and its per-request arrays ttfts, itls, input_lens, output_lens, errors) and `records`, every
request in full.
"""
from __future__ import annotations

import dataclasses
import html
import json
import math
from pathlib import Path

from loadtest import plots
from loadtest.types import RequestRecord

HEADLINE = [  # (summary key, column title, format)
    ("request_rate", "rate", "{}"), ("completed", "done", "{}"), ("failed", "failed", "{}"),
    ("request_throughput", "req/s", "{:.2f}"), ("request_goodput", "goodput req/s", "{:.2f}"),
    ("output_throughput", "out tok/s", "{:.1f}"), ("input_throughput", "in tok/s", "{:.1f}"),
    ("median_ttft_ms", "p50 TTFT ms", "{:.1f}"), ("p99_ttft_ms", "p99 TTFT ms", "{:.1f}"),
    ("median_tpot_ms", "p50 TPOT ms", "{:.2f}"), ("p99_itl_ms", "p99 ITL ms", "{:.2f}"),
    ("p99_e2el_ms", "p99 E2E ms", "{:.1f}"), ("cache_hit_ratio", "cache hit", "{:.1%}"),
    ("error_rate", "errors", "{:.1%}"),
]


def fmt(value, pattern: str = "{}") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return pattern.format(value)


def summary_table(result: dict):
    """The headline numbers of every run, for the terminal (rich)."""
    from rich.table import Table

    t = Table(title=f"brigade bench: {result['workload']} -> {result['backend']} {result['url']}")
    t.add_column("metric")
    for run in result["runs"]:
        t.add_column(f"rate {fmt(run['request_rate'])}", justify="right")
    for key, title, pattern in HEADLINE[1:]:
        t.add_row(title, *(fmt(run.get(key), pattern) for run in result["runs"]))
    return t


def to_json(result: dict) -> dict:
    runs = []
    for run in result["runs"]:
        recs: list[RequestRecord] = run["records"]
        runs.append({**run, "records": [dataclasses.asdict(r) for r in recs],
                     "ttfts": [r.ttft_s or 0.0 for r in recs], "itls": [list(_gaps(r)) for r in recs],
                     "input_lens": [r.prompt_tokens for r in recs], "output_lens": [r.output_tokens for r in recs],
                     "errors": [r.error or "" for r in recs]})
    return {**result, "runs": runs}


def _gaps(r: RequestRecord):
    return (b - a for a, b in zip(r.chunk_times_s, r.chunk_times_s[1:]))


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # inf rates are written as JSON's non-standard Infinity, which Python's json (and vLLM's) reads back.
    path.write_text(json.dumps(to_json(result), indent=1))
    return path


def load(path: Path) -> dict:
    """A result.json with its records as RequestRecord again; ValueError naming the file if it is not one."""
    try:
        result = json.loads(Path(path).read_text())
        fields = {f.name for f in dataclasses.fields(RequestRecord)}
        for run in result["runs"]:
            run["records"] = [RequestRecord(**{k: v for k, v in r.items() if k in fields}) for r in run["records"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path} is not a brigade bench result ({type(exc).__name__}: {exc})") from None
    return result


def write_html(result: dict, out_dir: Path) -> Path:
    """report.html and its figures in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = result["runs"]
    figures = [plots.latency_cdfs(runs, out_dir / "latency_cdfs.png")]
    if len(runs) > 1:
        figures.append(plots.sweep(runs, out_dir / "sweep.png"))
    for i, run in enumerate(runs):
        figures.append(plots.over_time(run, out_dir / f"over_time_{i}.png"))
    head = "".join(f"<th>{html.escape(title)}</th>" for _, title, _ in HEADLINE)
    rows = "".join("<tr>" + "".join(f"<td>{fmt(run.get(key), pattern)}</td>" for key, _, pattern in HEADLINE)
                   + "</tr>" for run in runs)
    latency_rows = "".join(
        f"<tr><td>{fmt(run['request_rate'])}</td><td>{name.upper()}</td>"
        + "".join(f"<td>{fmt(run.get(f'{stat}_{name}_ms'), '{:.2f}')}</td>" for stat in ("mean", "p50", "p90", "p99"))
        + "</tr>" for run in runs for name in ("ttft", "tpot", "itl", "e2el"))
    errors = "".join(f"<li>rate {fmt(run['request_rate'])}: {html.escape(json.dumps(run['errors_by_kind']))}</li>"
                     for run in runs if run["errors_by_kind"])
    slo = runs[0]["slo"] if runs else {}
    title = html.escape(f"brigade bench: {result['workload']} against {result['backend']} {result['url']}")
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{title}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}</style></head><body>
<h1>{title}</h1>
<p>{html.escape(result.get('label') or '')} {html.escape(result['date'])}; endpoint {result['endpoint']};
SLO {html.escape(json.dumps(slo) if slo else 'none (goodput not computed)')}</p>
<table><tr>{head}</tr>{rows}</table>
<h2>Latencies (ms)</h2>
<table><tr><th>rate</th><th>metric</th><th>mean</th><th>p50</th><th>p90</th><th>p99</th></tr>{latency_rows}</table>
{f'<h2>Errors by kind</h2><ul>{errors}</ul>' if errors else ''}
{''.join(f'<p><img src="{f.name}" alt="{f.stem}"></p>' for f in figures)}
<h2>Config</h2><pre>{html.escape(json.dumps(result['config'], indent=1))}</pre>
</body></html>
"""
    path = out_dir / "report.html"
    path.write_text(page)
    return path
