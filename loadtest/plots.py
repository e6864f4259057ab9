"""The report's figures (matplotlib, headless). Every figure is FIGSIZE at DPI, so a PNG is
800 x 450 pixels; a run is one line or colour, labelled by its request rate."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: never open a window, never need a display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from loadtest.metrics import itls, tpot  # noqa: E402

FIGSIZE = (8, 4.5)
DPI = 100


def rate_label(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}/s"


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def latency_cdfs(runs: list[dict], path: Path) -> Path:
    """CDFs of TTFT, TPOT, ITL and end-to-end latency, one line per run."""
    fig, axes = plt.subplots(2, 2, figsize=FIGSIZE)
    for run in runs:
        ok = [r for r in run["records"] if r.ok]
        series = {"TTFT": [r.ttft_s for r in ok], "TPOT": [t for r in ok if (t := tpot(r)) is not None],
                  "ITL": [g for r in ok for g in itls(r)], "E2E latency": [r.e2e_s for r in ok]}
        for ax, values in zip(axes.flat, series.values()):
            if values:
                ms = np.sort(np.asarray(values)) * 1000
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=rate_label(run["request_rate"]))
    for ax, name in zip(axes.flat, ("TTFT", "TPOT", "ITL", "E2E latency")):
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("ms", fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    if axes.flat[0].lines:
        axes.flat[0].legend(fontsize=7, title="request rate", title_fontsize=7)
    return _save(fig, path)


def over_time(run: dict, path: Path) -> Path:
    """TTFT (at each request's send time) and ITL (at each chunk's arrival) through the run."""
    fig, (ax_ttft, ax_itl) = plt.subplots(1, 2, figsize=FIGSIZE)
    ok = [r for r in run["records"] if r.ok]
    ax_ttft.scatter([r.start_s for r in ok], [r.ttft_s * 1000 for r in ok], s=6)
    times = [r.start_s + t for r in ok for t in r.chunk_times_s[1:]]
    ax_itl.scatter(times, [g * 1000 for r in ok for g in itls(r)], s=2, alpha=0.5)
    for ax, name in ((ax_ttft, "TTFT"), (ax_itl, "ITL")):
        ax.set_title(f"{name} over time ({rate_label(run['request_rate'])})", fontsize=9)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.set_ylabel("ms", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    return _save(fig, path)


def sweep(runs: list[dict], path: Path) -> Path:
    """Achieved throughput and goodput (requests/s) against the offered request rate."""
    fig, ax = plt.subplots(figsize=FIGSIZE)
    runs = sorted(runs, key=lambda r: r["request_rate"])  # inf last
    x = np.arange(len(runs))
    ax.plot(x, [r["request_throughput"] for r in runs], marker="o", label="throughput")
    if any(r["request_goodput"] is not None for r in runs):
        ax.plot(x, [r["request_goodput"] or 0.0 for r in runs], marker="s", label="goodput (met every SLO)")
    ax.set_xticks(x, [rate_label(r["request_rate"]) for r in runs])
    ax.set_xlabel("offered request rate")
    ax.set_ylabel("requests / s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    return _save(fig, path)
