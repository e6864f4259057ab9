"""Worker leases in Redis: who is alive, in which role, and which incarnation (epoch).

A worker is alive while its lease key exists; the key expires `ttl_s` after the last
heartbeat, so a crashed or partitioned worker drops out without anyone cleaning up.
The epoch changes at every registration, so a router can tell a restarted worker from
the one it knew (and drop what it believed about the old one's cache or requests).
"""
from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

log = logging.getLogger(__name__)

# KEYS: lease, id set. ARGV: worker id, ttl ms, epoch ("" = any). Refreshes only the caller's incarnation.
_HEARTBEAT = """
local e = redis.call('HGET', KEYS[1], 'epoch')
if not e or (ARGV[3] ~= '' and e ~= ARGV[3]) then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
# KEYS: the worker's epoch counter. The next epoch, and never below Redis's clock in 10 us
# units: a Redis that restarted empty (no persistence) must not hand out an epoch it gave before,
# or a router could take a restarted worker for the incarnation it knew. The counter runs ahead
# of the clock by one unit for each epoch minted within one unit, so the unit is finer than a
# round trip (in ms, three registrations and a wipe once fitted in one unit and repeated an
# epoch). Epochs stay below 2^53 / 8 (until the year 2326), so a block entry (epoch * 8 + tiers)
# is still exact as a Lua number; they only grew when the unit left ms.
_NEXT_EPOCH = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 100000 + math.floor(tonumber(t[2]) / 10)
local e = redis.call('INCR', KEYS[1])
if e < now then redis.call('SET', KEYS[1], now); e = now end
return e
"""
# KEYS: lease, id set. ARGV: worker id, epoch ("" = any). Never deletes a newer incarnation's lease.
_DEREGISTER = """
local e = redis.call('HGET', KEYS[1], 'epoch')
if e and ARGV[2] ~= '' and e ~= ARGV[2] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('SREM', KEYS[2], ARGV[1])
return e and 1 or 0
"""


class RegistryError(RuntimeError):
    """Redis is unreachable or refused us; the message says which and never contains the password."""


@dataclass(frozen=True)
class WorkerInfo:
    worker_id: str
    role: str
    epoch: int
    started_at: float  # the worker's time.time() at registration
    info: dict[str, Any] = field(default_factory=dict)  # address, ports, TP size...: what the router needs


def _redact(url: str) -> str:
    return re.sub(r"//[^@/]*@", "//***@", url)


def connect(url: str, must_answer: bool = True, **kwargs: Any) -> redis.Redis:
    """A client for `url` that has answered PING; failures become a RegistryError that says why.
    With must_answer=False an unreachable Redis still gives the client (a refused password never does)."""
    kwargs.setdefault("socket_connect_timeout", 5.0)
    kwargs.setdefault("socket_timeout", 5.0)  # a hung Redis must not hang a heartbeat forever
    client = redis.Redis.from_url(url, decode_responses=True, **kwargs)
    has_password = bool(client.connection_pool.connection_kwargs.get("password"))
    try:
        client.ping()
    except redis.AuthenticationError as e:  # never retried without the password
        what = "refused the password in the URL" if has_password else "requires a password (redis://:PASSWORD@...)"
        raise RegistryError(f"Redis at {_redact(url)} {what}: {e}") from None
    except redis.RedisError as e:
        if must_answer:
            raise RegistryError(f"cannot reach Redis at {_redact(url)}: {e}") from None
    return client


class WorkerRegistry:
    """Leases under `{prefix}:worker:{id}` (a hash with a TTL) plus a set of ids, so listing never SCANs.

    Takes a URL (connected and checked here) or a ready client made with decode_responses=True.
    """

    def __init__(self, redis_url_or_client: str | redis.Redis, prefix: str = "brigade", ttl_s: float = 10.0):
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        r = redis_url_or_client
        self.redis = connect(r) if isinstance(r, str) else r
        self.prefix, self.ttl_s = prefix, ttl_s
        self._ids = f"{prefix}:workers"
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._deregister = self.redis.register_script(_DEREGISTER)
        self._next_epoch = self.redis.register_script(_NEXT_EPOCH)

    def _key(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    def register(self, worker_id: str, role: str, info: dict[str, Any] | None = None) -> int:
        """(Re)starts the lease; returns the new epoch, which the worker passes to heartbeat()."""
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        epoch = int(self._next_epoch(keys=[f"{self.prefix}:epoch:{worker_id}"]))  # never expires: epochs only grow
        fields = {"role": role, "epoch": epoch, "info": json.dumps(info or {}), "started_at": time.time()}
        with self.redis.pipeline(transaction=True) as p:
            p.delete(self._key(worker_id)).hset(self._key(worker_id), mapping=fields)
            p.pexpire(self._key(worker_id), int(self.ttl_s * 1000)).sadd(self._ids, worker_id).execute()
        return epoch

    def heartbeat(self, worker_id: str, epoch: int | None = None) -> bool:
        """Extends the lease; False if it already expired or (given `epoch`) a newer registration replaced it."""
        args = [worker_id, int(self.ttl_s * 1000), "" if epoch is None else str(epoch)]
        return bool(self._heartbeat(keys=[self._key(worker_id), self._ids], args=args))

    def deregister(self, worker_id: str, epoch: int | None = None) -> bool:
        """Ends the lease now (graceful drain); False if there was none, or it belongs to another epoch."""
        args = [worker_id, "" if epoch is None else str(epoch)]
        return bool(self._deregister(keys=[self._key(worker_id), self._ids], args=args))

    def live_workers(self, role: str | None = None) -> list[WorkerInfo]:
        """Workers whose lease has not expired, sorted by id; ids of expired leases are pruned."""
        ids = sorted(self.redis.smembers(self._ids))
        with self.redis.pipeline(transaction=False) as p:
            for wid in ids:
                p.hgetall(self._key(wid))
            hashes = p.execute()
        out = []
        for wid, h in zip(ids, hashes):
            if not h:
                self.deregister(wid, epoch=0)  # epochs start at 1: this only prunes an id whose lease is gone
                continue
            try:  # anyone with access to Redis may have written it: a bad lease is skipped, never fatal
                info = WorkerInfo(wid, str(h["role"]), int(h["epoch"]), float(h["started_at"]), json.loads(h["info"]))
            except (KeyError, ValueError, TypeError) as exc:
                log.warning("skipped the malformed worker lease %.80r: %s: %.80s", wid, type(exc).__name__, exc)
                continue
            if role is None or info.role == role:
                out.append(info)
        return out


class Heartbeat:
    """A daemon thread that refreshes one lease every ttl/3, so two lost beats still leave it alive.

    Redis errors are logged and retried (a blip must not kill the worker); a lease found
    expired or superseded stops the thread and calls `on_lost`, since only a new
    registration (new epoch) may bring the worker back.
    """

    def __init__(self, registry: WorkerRegistry, worker_id: str, epoch: int,
                 on_lost: Callable[[], None] | None = None):
        self.registry, self.worker_id, self.epoch, self.on_lost = registry, worker_id, epoch, on_lost
        self.lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{worker_id}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.registry.ttl_s / 3):
            try:
                alive = self.registry.heartbeat(self.worker_id, self.epoch)
            except redis.RedisError as e:
                log.warning("heartbeat for %s failed, retrying: %s", self.worker_id, e)
                continue
            if not alive:
                log.error("lease of %s (epoch %d) lost", self.worker_id, self.epoch)
                self.lost.set()
                if self.on_lost is not None:
                    self.on_lost()
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
