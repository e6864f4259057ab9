"""Chaos: slow readers at the HTTP door. Clients stream `max_tokens` 2,000 with 20
logprobs per token (the largest chunks there are) and read a few hundred bytes a second, from a
socket with a small receive buffer. Each stream runs at most STREAM_WINDOW_CHUNKS ahead of its
reader at every hop, and the decode worker holds a request in its engine once HOLD_AT chunks
wait unread there: every stream is held having generated a small part of its 2,000 tokens, the
decode worker's KV and memory stay small, and the serve process, where the doors are, holds
next to none of the answers: its RSS stays flat (without the window it would receive every
chunk, ~3 KB each). The readers then leave: every request is aborted, the KV pools are whole and
the door serves. CI runs 8 readers; BRIGADE_CHAOS_FULL=1 runs 50 and
records the figure."""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import ray
from serve_process import Served, brigade_serve, door_in_flight, find_process, ray_driver
from support import FULL, wait_for

READERS = 50 if FULL else 8
MAX_TOKENS = 2000
BODY = {"prompt": [5, 6, 7], "max_tokens": MAX_TOKENS, "logprobs": 20, "stream": True, "ignore_eos": True,
        "temperature": 1.0}
READ_BYTES, READ_EVERY_S = 256, 0.5
BLOCK_SIZE = 16
NUM_BLOCKS = READERS * (-(-(MAX_TOKENS + 3) // BLOCK_SIZE)) + 64
RSS_GROWTH_LIMIT_MB = 100.0
CI_RSS_GROWTH_LIMIT_MB = 20.0  # 8 readers: without the window the serve process would take ~45 MB
# Tokens a held stream may have generated: the windows of its hops, the door's socket buffers and
# what its reader read, all far below MAX_TOKENS (without the hold each generates all 2,000).
HELD_TOKENS_LIMIT = 400

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tmp = tmp_path_factory.mktemp("slow_readers")
    flags = ["--http-port", "0", "--grpc-port", "0", "--num-blocks", str(NUM_BLOCKS), "--max-num-seqs", "64"]
    with brigade_serve(flags, tmp / "serve.log") as s:
        with ray_driver(s):
            yield s


class SlowReader(threading.Thread):
    """One streaming request read READ_BYTES every READ_EVERY_S until `stop`."""

    def __init__(self, host: str, port: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
        self.sock.settimeout(60)
        self.sock.connect((host, port))
        body = json.dumps(BODY).encode()
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        self.stop, self.received, self.first = stop, 0, threading.Event()

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                got = self.sock.recv(READ_BYTES)
                if not got:
                    break
                self.received += len(got)
                self.first.set()
                self.stop.wait(READ_EVERY_S)
        except OSError:
            pass
        finally:
            self.sock.close()


def decode_stats() -> dict:
    return ray.get(ray.get_actor("decode-0").stats.remote(), timeout=30)


def test_slow_readers_leave_the_serve_process_flat(served: Served, chaos_figure) -> None:
    door = psutil.Process(served.proc.pid)
    decode = find_process(served, "ray::DecodeActor")
    host, port = served.http_base.removeprefix("http://").rsplit(":", 1)
    stop = threading.Event()
    readers = [SlowReader(host, int(port), stop) for _ in range(READERS)]
    try:
        for r in readers:
            r.start()
        for r in readers:
            assert r.first.wait(120), "a stream never started"
        door_before, decode_before = door.memory_info().rss, decode.memory_info().rss
        began = time.monotonic()
        # Every stream held by its decode engine: without the hold each would generate all 2,000.
        wait_for(lambda: decode_stats()["held"] == READERS, 300,
                 lambda: f"every stream held; now {decode_stats()}", 0.5)
        hold_s = time.monotonic() - began
        held = decode_stats()
        time.sleep(2 * READ_EVERY_S)  # whatever was in transit arrives
        door_growth = (door.memory_info().rss - door_before) / 2**20
        decode_growth = (decode.memory_info().rss - decode_before) / 2**20
        received = sum(r.received for r in readers)
    finally:
        stop.set()
        for r in readers:
            r.join(30)
    # The readers left: every request aborted, every block back, and the door still serves.
    wait_for(lambda: (s := decode_stats())["free_blocks"] == s["num_blocks"] and s["running"] == 0, 120,
             lambda: f"the decode pool whole; now {decode_stats()}", 0.5)
    # And the door is done with them too (each handler ends once the router confirmed its abort).
    wait_for(lambda: door_in_flight(served) == 0, 30, lambda: f"the door idle; {door_in_flight(served)} left", 0.5)
    ok = httpx.post(f"{served.http_base}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=120)
    chaos_figure("slow_readers", ratios={"rss_growth_mb": round(door_growth, 1)},
                 targets={"rss_growth_mb": f"< {RSS_GROWTH_LIMIT_MB:g}"}, readers=READERS, max_tokens=MAX_TOKENS,
                 logprobs=BODY["logprobs"], all_held_s=round(hold_s, 1), bytes_read=received,
                 decode_referenced_blocks=held["referenced_blocks"],
                 decode_worker_rss_growth_mb=round(decode_growth, 1), completion_after=ok.status_code)
    print(f"\nslow readers: {READERS} streams all held by the decode engine after {hold_s:.0f} s, holding "
          f"{held['referenced_blocks']} KV blocks; serve process RSS +{door_growth:.1f} MB, decode worker "
          f"+{decode_growth:.1f} MB; {received} bytes read")
    assert door_growth < (RSS_GROWTH_LIMIT_MB if FULL else CI_RSS_GROWTH_LIMIT_MB)
    assert held["referenced_blocks"] <= READERS * -(-(len(BODY["prompt"]) + HELD_TOKENS_LIMIT) // BLOCK_SIZE)
    assert ok.status_code == 200
