"""The prefix index in Redis, the router's query: which worker holds the longest prefix, in which tier.

Layout (every key under the configured prefix, so an ACL user limited to `~PREFIX:*` works):

    PREFIX:MODEL:blk:HEX       hash  worker id -> epoch * 8 + tier mask (1 device, 2 host, 4 disk)
    PREFIX:MODEL:pub:WORKER    hash  seq, epoch: the worker's last published batch
    PREFIX:MODEL:resync:WORKER flag  set by anyone: the worker re-publishes its whole cache

HEX is a chained block hash (engine.block_hash), so a key names a whole prefix and a cache
salt is already in it. An entry counts only while its worker holds a live lease of the same
epoch (router.index.registry): the query takes the live (worker, epoch) pairs as arguments, so a
restarted or expired worker's entries never count, and its stale fields are overwritten when
it stores the block again. The index is a hint: a wrong entry costs a recompute.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import redis

from router.index.keys import IndexKeys
from router.index.registry import WorkerRegistry

# KEYS: the request's block keys, in chain order. ARGV: n, then n (worker id, epoch) pairs.
# Returns per worker, in argument order: leading blocks held, and of those how many are best
# found on device, host, disk. One HMGET per block while any worker's run goes on.
_LONGEST_PREFIX = """
local n = tonumber(ARGV[1])
local ids, epochs, out, active = {}, {}, {}, {}
for w = 1, n do
  ids[w] = ARGV[2 * w]; epochs[w] = tonumber(ARGV[2 * w + 1])
  out[4 * w - 3] = 0; out[4 * w - 2] = 0; out[4 * w - 1] = 0; out[4 * w] = 0
  active[w] = w
end
for b = 1, #KEYS do
  if #active == 0 then break end
  local fields = {}
  for j = 1, #active do fields[j] = ids[active[j]] end
  -- pcall: a key that is not a hash (anyone may write here) ends the chain, not the query.
  local values = redis.pcall('HMGET', KEYS[b], unpack(fields))
  if type(values) ~= 'table' or values.err then values = {} end
  local still = {}
  for j = 1, #active do
    local w, v = active[j], tonumber(values[j])
    if v then
      local mask = v % 8
      if mask ~= 0 and (v - mask) / 8 == epochs[w] then
        out[4 * w - 3] = out[4 * w - 3] + 1
        if mask % 2 == 1 then out[4 * w - 2] = out[4 * w - 2] + 1
        elseif mask % 4 >= 2 then out[4 * w - 1] = out[4 * w - 1] + 1
        else out[4 * w] = out[4 * w] + 1 end
        still[#still + 1] = w
      end
    end
  end
  active = still
end
return out
"""


@dataclass(frozen=True)
class PrefixHit:
    """A worker's leading cached blocks for one request, by the fastest tier holding each."""

    blocks: int = 0
    device: int = 0
    host: int = 0
    disk: int = 0


class PrefixIndex:
    """The router's side: longest-prefix queries in one round trip (EVALSHA; the script is
    re-sent by redis-py after a Redis restart). Takes a client made with decode_responses=True."""

    def __init__(self, client: redis.Redis, prefix: str, model_id: str):
        self.redis = client
        self.keys = IndexKeys(prefix, model_id)
        self.registry = WorkerRegistry(client, prefix=prefix)
        self._query = client.register_script(_LONGEST_PREFIX)

    def live_epochs(self, role: str | None = None) -> dict[str, int]:
        """Worker id -> epoch of every live lease: the only entries a query should count."""
        return {w.worker_id: w.epoch for w in self.registry.live_workers(role)}

    def query(self, hashes: Sequence[bytes], workers: Mapping[str, int]) -> dict[str, PrefixHit]:
        """For each live worker (id -> lease epoch): its leading held blocks of `hashes`."""
        ids = sorted(workers)
        if not ids or not hashes:
            return {w: PrefixHit() for w in ids}
        args: list = [len(ids)]
        for w in ids:
            args += [w, workers[w]]
        flat = self._query(keys=[self.keys.block(h) for h in hashes], args=args)
        return {w: PrefixHit(*map(int, flat[4 * i: 4 * i + 4])) for i, w in enumerate(ids)}

    def request_resync(self, worker_id: str) -> None:
        """Ask a worker to re-publish its whole cache (it polls the flag with every batch)."""
        self.redis.set(self.keys.resync(worker_id), 1)
