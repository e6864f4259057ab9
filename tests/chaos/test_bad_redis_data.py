"""Chaos: Redis holds garbage, against a real `brigade serve` (`tiny`, 1 prefill + 1
decode) over a real redis-server the test owns (`--redis-url`). Malformed worker leases and
index entries of every kind are written next to the real ones; requests whose prompts hit the
corrupted entries are still served, and when the decode worker's process is then SIGKILLed it is
still ejected (/health 503) and replaced by the supervisor (a new process, /health 200, a
completion 200): no bad record stops the router's health loop or the index view."""
from __future__ import annotations

import signal
import time

import httpx
import pytest
import redis
from serve_process import brigade_serve, find_process
from support import wait_for

PREFIX = "brigade"
PROMPT = {"prompt": list(range(3, 67)), "max_tokens": 3, "temperature": 0}  # 4 blocks of 16
RECOVERY_S = 180.0  # a new worker loads the model and pairs, on two shared cores

pytestmark = [pytest.mark.slow, pytest.mark.extended, pytest.mark.timeout(600)]


def write_bad_leases(r: redis.Redis) -> None:
    bad = {"no-epoch": {"role": "prefill", "started_at": "1", "info": "{}"},
           "epoch-not-a-number": {"role": "decode", "epoch": "x", "started_at": "1", "info": "{}"},
           "info-not-json": {"role": "decode", "epoch": "3", "started_at": "1", "info": "{not json"},
           "role-unknown": {"role": "\x00" * 8, "epoch": "1", "started_at": "nan", "info": "[]"}}
    for wid, fields in bad.items():
        r.hset(f"{PREFIX}:worker:{wid}", mapping=fields)
        r.sadd(f"{PREFIX}:workers", wid)
    r.set(f"{PREFIX}:worker:not-a-hash", "x")
    r.sadd(f"{PREFIX}:workers", "not-a-hash", "missing-lease")


def corrupt_index(r: redis.Redis) -> int:
    """Every block entry of the served prompt turned bad, each in another way; how many."""
    keys = sorted(r.scan_iter(f"{PREFIX}:*:blk:*"))
    for i, key in enumerate(keys):
        if i % 3 == 0:
            r.delete(key)
            r.set(key, "not a hash")  # the wrong type
        elif i % 3 == 1:
            r.hset(key, mapping={"prefill-0": "garbage", "decode-0": "-1e999"})
        else:
            r.hset(key, "no-such-worker", "12")
    return len(keys)


def health(base: str) -> int:
    return httpx.get(f"{base}/health", timeout=30).status_code


def complete(base: str) -> int:
    return httpx.post(f"{base}/v1/completions", json=PROMPT, timeout=120).status_code


def test_bad_leases_and_index_entries_do_not_stop_a_dead_worker_being_replaced(tmp_path, redis_server,
                                                                               chaos_figure) -> None:
    config = tmp_path / "cluster.yaml"
    config.write_text("router: {health_interval_s: 0.5}\nsupervisor: {grace_s: 2.0, interval_s: 0.5}\n")
    flags = ["--config", str(config), "--http-port", "0", "--grpc-port", "0", "--num-blocks", "128",
             "--redis-url", redis_server.url]
    r = redis.Redis.from_url(redis_server.url, decode_responses=True)
    with brigade_serve(flags, tmp_path / "serve.log") as served:
        base = served.http_base
        assert complete(base) == 200
        wait_for(lambda: any(r.scan_iter(f"{PREFIX}:*:blk:*")), 30, "the prompt's blocks in the index", 0.1)
        write_bad_leases(r)
        corrupted = corrupt_index(r)
        assert complete(base) == 200  # routed over the corrupted entries
        time.sleep(2.0)  # a few health rounds and index refreshes over the bad leases
        assert health(base) == 200

        victim = find_process(served, "ray::DecodeActor")
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: health(base) == 503, 60, "the dead decode worker ejected (/health 503)", 0.1)
        ejected_s = time.monotonic() - killed
        wait_for(lambda: health(base) == 200, RECOVERY_S, "a replacement serving (/health 200)", 0.5)
        replaced_s = time.monotonic() - killed
        assert find_process(served, "ray::DecodeActor").pid != victim.pid
        assert complete(base) == 200
        log = served.log.read_text()
    chaos_figure("bad_redis_data", ratios={"replaced": 1.0, "ejected_s": round(ejected_s, 2)},
                 targets={"replaced": "== 1.0"}, corrupted_index_entries=corrupted,
                 replaced_s=round(replaced_s, 1))
    print(f"\nbad redis data: {corrupted} index entries corrupted; the killed decode worker ejected after "
          f"{ejected_s:.1f} s, replaced after {replaced_s:.1f} s")
    assert "health check round failed" not in log, log[-3000:]  # nothing made a round raise
