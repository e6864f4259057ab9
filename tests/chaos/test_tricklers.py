"""Chaos: 500 trickling clients at the HTTP door of a real `brigade serve`. Each opens
a connection and sends its request one byte every TRICKLE_EVERY_S, never finishing the headers.
The door holds at most frontdoor.max_connections (here CAP) of them, each with a thread, and
answers the rest 503 at once; the header deadline (header_timeout_s) then cuts the held ones
off, however steadily they trickle, without a traceback in the log for each. The serve
process's RSS stays bounded throughout, and once they are gone a completion answers 200.
Counts are the same in CI and BRIGADE_CHAOS_FULL=1 (cheap: one thread drives every socket);
the full run records the figure."""
from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
from serve_process import Served, brigade_serve

TRICKLERS = 500
CAP = 256
HEADER_TIMEOUT_S = 5.0
TRICKLE_EVERY_S = 2.0
RSS_GROWTH_LIMIT_MB = 100.0
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" * 20

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("tricklers")
    config = tmp / "cluster.yaml"
    config.write_text(f"frontdoor: {{max_connections: {CAP}, header_timeout_s: {HEADER_TIMEOUT_S}}}\n")
    flags = ["--config", str(config), "--http-port", "0", "--grpc-port", "0", "--num-blocks", "64"]
    with brigade_serve(flags, tmp / "serve.log") as s:
        yield s


class Trickler:
    def __init__(self, host: str, port: int):
        self.sock = socket.create_connection((host, port), timeout=30)
        self.sock.setblocking(False)
        self.sent, self.reply, self.closed_at = 0, b"", None
        self.opened = time.monotonic()

    def trickle(self) -> None:
        try:
            self.sock.send(REQUEST[self.sent % len(REQUEST):][:1])
            self.sent += 1
        except OSError:
            self.closed()

    def read(self) -> None:
        try:
            got = self.sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            got = b""
        self.reply += got
        if not got:
            self.closed()

    def closed(self) -> None:
        if self.closed_at is None:
            self.closed_at = time.monotonic()
            self.sock.close()

    @property
    def refused(self) -> bool:
        return self.reply.startswith(b"HTTP/1.1 503")


def test_tricklers_are_capped_and_cut_off_and_cost_no_memory(served: Served, chaos_figure) -> None:
    door = psutil.Process(served.proc.pid)
    host, port = served.http_base.removeprefix("http://").rsplit(":", 1)
    before = door.memory_info().rss
    clients = [Trickler(host, int(port)) for _ in range(TRICKLERS)]
    peak, end = before, time.monotonic() + 3 * HEADER_TIMEOUT_S + 10
    poller = select.poll()
    by_fd = {c.sock.fileno(): c for c in clients}
    for fd in by_fd:
        poller.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    next_byte = time.monotonic()
    while time.monotonic() < end and any(c.closed_at is None for c in clients):
        if time.monotonic() >= next_byte:
            for c in clients:
                if c.closed_at is None:
                    c.trickle()
            next_byte += TRICKLE_EVERY_S
        for fd, _ in poller.poll(100):
            c = by_fd[fd]
            if c.closed_at is None:
                c.read()
            if c.closed_at is not None:
                poller.unregister(fd)
        peak = max(peak, door.memory_info().rss)
    refused = [c for c in clients if c.refused]
    held = [c for c in clients if not c.refused]
    cut_off = all(c.closed_at is not None for c in held)  # by the server, before we close the rest
    held_s = sorted(c.closed_at - c.opened for c in held if c.closed_at is not None)
    for c in clients:
        c.closed()
    ok = httpx.post(f"{served.http_base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=120)
    growth = (peak - before) / 2**20
    chaos_figure("tricklers", ratios={"rss_growth_mb": round(growth, 1), "refused_fraction": len(refused) / TRICKLERS},
                 targets={"rss_growth_mb": f"< {RSS_GROWTH_LIMIT_MB:g}",
                          "refused_fraction": f">= {(TRICKLERS - CAP) / TRICKLERS:g}"},
                 tricklers=TRICKLERS, cap=CAP, refused=len(refused), header_timeout_s=HEADER_TIMEOUT_S,
                 held_s_max=round(held_s[-1], 1) if held_s else None, completion_after=ok.status_code)
    print(f"\ntricklers: {len(refused)} refused 503, {len(held)} held and cut off after at most "
          f"{held_s[-1] if held_s else 0:.1f} s; serve RSS +{growth:.1f} MB")
    assert len(refused) >= TRICKLERS - CAP
    assert cut_off and held_s[-1] < 2 * HEADER_TIMEOUT_S + 5
    assert growth < RSS_GROWTH_LIMIT_MB
    assert ok.status_code == 200
    assert "Traceback" not in served.log.read_text()  # cut-off clients are routine, not errors
