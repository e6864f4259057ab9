"""Live progress on stderr (rich): completed/failed, current throughput, running p50 TTFT."""
from __future__ import annotations

import time
from collections import deque

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from loadtest.types import RequestRecord

WINDOW_S = 10.0  # "current" throughput is over the last this many seconds
REFRESH_S = 0.25  # stats are recomputed at most this often (the median is O(n))


class LiveProgress:
    def __init__(self, title: str, total: int, enabled: bool = True):
        self.progress = Progress(TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("{task.fields[stats]}"), TimeElapsedColumn(),
                                 console=Console(stderr=True), disable=not enabled, transient=False)
        self.task = self.progress.add_task(title, total=total, stats="")
        self.failed = 0
        self.ttfts: list[float] = []
        self.recent: deque[tuple[float, int]] = deque()  # (finish time, output tokens)
        self._shown = 0.0
        self.started = time.perf_counter()

    def __enter__(self) -> LiveProgress:
        self.started = time.perf_counter()
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self._refresh(force=True)
        self.progress.stop()

    def add(self, record: RequestRecord) -> None:
        now = time.perf_counter()
        if record.ok:
            self.ttfts.append(record.ttft_s)
            self.recent.append((now, record.output_tokens))
        else:
            self.failed += 1
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        self.progress.advance(self.task)
        self._refresh()

    def _refresh(self, force: bool = False) -> None:
        now = time.perf_counter()
        if not force and now - self._shown < REFRESH_S:
            return
        self._shown = now
        span = min(WINDOW_S, max(1e-3, now - self.started))
        p50 = f"{np.median(self.ttfts) * 1000:.0f} ms" if self.ttfts else "-"
        self.progress.update(self.task, stats=(
            f"failed {self.failed} | {len(self.recent) / span:.2f} req/s, "
            f"{sum(n for _, n in self.recent) / span:.0f} out tok/s | p50 TTFT {p50}"))
