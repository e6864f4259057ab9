"""Run one engine's model over a group of ranks: rank 0 owns the scheduler and the sampler,
the other ranks follow.

Each step rank 0 broadcasts an op header (4 int64) and then the op's arguments as one int64
tensor: explicit integers, never pickle. The batch is sent as what ModelRunner._prepare reads
(per sequence: computed tokens, new tokens, samples flag, block table and the new token ids),
so every rank builds the same attention metadata and runs the same forward; the collectives
inside the model keep them in lock step. Followers block in follow() until STOP.
Rank 0 sends each op and its collectives under one lock, so ops from different threads (the
engine step, a KV write from a receiving thread, the keepalive) never interleave; while idle
it sends PING every timeout_s/4, so followers wait within their bounded timeout and a rank
that died is noticed (healthy turns False) even without traffic.

KV import/export in a group, two ways:
- through rank 0: WRITE_KV broadcasts the block ids and scatters the KV, each rank receiving
  only its own heads; READ_KV gathers each rank's heads of the blocks back to rank 0.
- rank by rank (kv_transfer.reshard, each rank its own transfer pairs): WRITE_LOCAL
  broadcasts the request (id and peer as UTF-8 bytes, token count, block ids) and every follower
  takes its heads from its `receive_local` hook and writes them; READ_LOCAL has every rank
  read its own heads and hand them to its `send_local` hook. Both end with an all-reduce of
  failures, so a rank whose transfer failed fails the request (LocalKVFailed), not the group.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch
import torch.distributed as dist

from engine.model_runner import ModelRunner
from engine.models import CausalLM
from engine.parallel.group import Group, GroupFailed
from engine.parallel.sharding import ShardPlan, kv_head_range


class Op(IntEnum):
    STOP = 0
    STEP = 1
    WRITE_KV = 2
    READ_KV = 3
    WRITE_LOCAL = 4
    PING = 5
    READ_LOCAL = 6


class LocalKVFailed(RuntimeError):
    """A rank could not receive or send its KV heads of a request; the group is still fine."""


@dataclass
class _Window:
    """token_ids of a follower's sequence: only the ids this step computes, at their positions."""

    start: int
    ids: list[int]

    def __getitem__(self, s: slice) -> list[int]:
        return self.ids[s.start - self.start : s.stop - self.start]


@dataclass
class _Seq:
    token_ids: _Window
    num_computed: int
    block_table: list[int]


@dataclass
class _Scheduled:
    seq: _Seq
    num_new_tokens: int
    samples: bool
    num_draft: int = 0  # speculative proposals (engine/spec; never on parallel ranks: refused at config)


def encode_batch(batch, block_size: int) -> list[int]:
    out = [len(batch)]
    for s in batch:
        start, n = s.seq.num_computed, s.num_new_tokens
        table = s.seq.block_table[: -(-(start + n) // block_size)]
        out += [start, n, int(s.samples), len(table), *s.seq.token_ids[start : start + n], *table]
    return out


def decode_batch(flat: list[int]) -> list[_Scheduled]:
    batch, i = [], 1
    for _ in range(flat[0]):
        start, n, samples, nb = flat[i : i + 4]
        i += 4
        ids, table = flat[i : i + n], flat[i + n : i + n + nb]
        i += n + nb
        batch.append(_Scheduled(_Seq(_Window(start, ids), start, table), n, bool(samples)))
    return batch


class ParallelModelRunner(ModelRunner):
    """A ModelRunner whose pool holds this rank's KV heads; run/read/write drive the group."""

    def __init__(self, model: CausalLM, plan: ShardPlan, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, group: Group):
        super().__init__(model, plan.local_config(), num_blocks, block_size, dtype, device)
        self.plan, self.group = plan, group
        # A follower's owner sets these for rank-by-rank KV transfer (see the module doc):
        # receive_local(request_id, num_tokens, peer) -> this rank's KV (2, L, nb, bs, Hkv_local, hd)
        # from peer (the other worker's id); send_local(request_id, num_tokens, kv, peer) sends it on.
        self.receive_local: Callable[[str, int, str], torch.Tensor] | None = None
        self.send_local: Callable[[str, int, torch.Tensor, str], None] | None = None
        self.last_local_error: BaseException | None = None
        self._lock = threading.Lock()
        self._last_op = time.monotonic()
        self._keepalive: threading.Thread | None = None
        self.error: BaseException | None = None

    @property
    def healthy(self) -> bool:
        return self.error is None and not self.group.closed

    def health(self) -> dict:
        report = {"tp_size": self.plan.tp_size, "ep_size": self.plan.ep_size}
        if not self.healthy:  # a partial group must get no traffic
            report |= {"alive": False, "error": f"parallel group down: {self.error!r}"}
        return report

    def close(self) -> None:
        if self.is_leader:
            self.stop_followers()
        else:
            self.group.close()

    @property
    def is_leader(self) -> bool:
        return self.group.rank == 0

    # -- rank 0 ---------------------------------------------------------------
    @torch.inference_mode()
    def run(self, batch) -> torch.Tensor:
        with self._op(Op.STEP, encode_batch(batch, self.block_size)):
            logits = super().run(batch)
            if self.device.type == "cuda":  # the sampler would sync next: sync here and check first
                torch.cuda.current_stream(self.device).synchronize()
                self.group.check()
            return logits

    def write_blocks(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """kv: (2, L, nb, bs, Hkv_total, hd), on rank 0; each rank receives and keeps its heads."""
        with self._op(Op.WRITE_KV, block_ids):
            self._write_full(block_ids, kv.to(self.device, self.kv_cache.dtype).contiguous())

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """All KV heads of these blocks, gathered to rank 0: (2, L, nb, bs, Hkv_total, hd)."""
        with self._op(Op.READ_KV, block_ids):
            return self._read_full(block_ids)

    def write_local(self, request_id: str, num_tokens: int, block_ids: list[int], kv: torch.Tensor,
                    peer: str = "") -> None:
        """Write rank 0's heads `kv` into the blocks while every follower writes the heads its
        receive_local hook returns. LocalKVFailed if any rank failed (nothing is usable then)."""
        with self._op(Op.WRITE_LOCAL, _request_args(request_id, num_tokens, block_ids, peer)):
            self._all_ok(lambda: super(ParallelModelRunner, self).write_blocks(block_ids, kv), "receive")

    def read_local(self, request_id: str, num_tokens: int, block_ids: list[int], peer: str = "") -> torch.Tensor:
        """Rank 0's heads of the blocks, while every follower reads its own and hands them to its
        send_local hook. LocalKVFailed if a follower failed to send."""
        with self._op(Op.READ_LOCAL, _request_args(request_id, num_tokens, block_ids, peer)):
            out: list[torch.Tensor] = []
            self._all_ok(lambda: out.append(super(ParallelModelRunner, self).read_blocks(block_ids)), "send")
            return out[0]

    def ping(self) -> None:
        """Keeps idle followers inside their timeout; fails fast if a rank is gone."""
        with self._op(Op.PING, []):
            pass

    def start_keepalive(self) -> ParallelModelRunner:
        self._keepalive = threading.Thread(target=self._keep_alive, name="parallel-keepalive", daemon=True)
        self._keepalive.start()
        return self

    def stop_followers(self) -> None:
        """Release the followers (they return from follow()) and close the group."""
        if self.healthy:
            with self._op(Op.STOP, []):
                pass
        self.group.close()

    @contextlib.contextmanager
    def _op(self, op: Op, args: list[int]):
        with self._lock:
            if self.group.closed:
                raise GroupFailed(f"the parallel group is down: {self.error!r}")
            try:
                self.group.broadcast(torch.tensor([int(op), len(args), 0, 0], dtype=torch.long,
                                                  device=self.device))
                if args:
                    self.group.broadcast(torch.tensor(args, dtype=torch.long, device=self.device))
                yield
            except LocalKVFailed:
                raise  # the ranks agreed on it: still in step
            except BaseException as exc:
                self.error = self.error or exc
                self.group.close(failed=True)  # a half-done op leaves the ranks out of step: never reuse
                raise
            finally:
                self._last_op = time.monotonic()

    def _keep_alive(self) -> None:
        period = self.group.timeout_s / 4
        while not self.group.closed:
            time.sleep(min(period, 1.0))
            if time.monotonic() - self._last_op >= period:
                try:
                    self.ping()
                except Exception:
                    return  # recorded in self.error; healthy is False from now on

    # -- every rank -------------------------------------------------------------
    def follow(self) -> None:
        """A follower's loop: run what rank 0 broadcasts until STOP (or the group fails)."""
        try:
            while self._follow_one():
                pass
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self.group.close(failed=self.error is not None)

    def _follow_one(self) -> bool:
        header = self.group.broadcast(torch.empty(4, dtype=torch.long, device=self.device)).tolist()
        self.group.check()  # before trusting what the host just read
        op, n = Op(header[0]), header[1]
        args = self.group.broadcast(torch.empty(n, dtype=torch.long, device=self.device)).tolist() if n else []
        self.group.check()
        if op is Op.STEP:
            with torch.inference_mode():
                ModelRunner.run(self, decode_batch(args))
        elif op is Op.WRITE_KV:
            self._write_full(args, None)
        elif op is Op.READ_KV:
            self._read_full(args)
        elif op is Op.WRITE_LOCAL:
            rid, n, blocks, peer = _parse_request_args(args)
            self._all_ok(lambda: ModelRunner.write_blocks(self, blocks, self.receive_local(rid, n, peer)), "receive")
        elif op is Op.READ_LOCAL:
            rid, n, blocks, peer = _parse_request_args(args)
            self._all_ok(lambda: self.send_local(rid, n, ModelRunner.read_blocks(self, blocks), peer), "send")
        return op is not Op.STOP

    def _heads_of(self, rank: int) -> tuple[int, int]:
        """(first KV head, count) rank `rank` holds; with EP only (tp 1) every rank holds all."""
        cfg = self.plan.cfg
        if self.plan.tp_size == 1:
            return 0, cfg.num_kv_heads
        return kv_head_range(cfg.num_heads, cfg.num_kv_heads, self.plan.tp_size, rank)

    def _write_full(self, block_ids: list[int], kv: torch.Tensor | None) -> None:
        """Rank 0 holds all heads (kv); each rank receives only its own heads (one scatter)."""
        cfg, count = self.plan.cfg, self.plan.kv_heads[1]
        mine = torch.empty((2, cfg.num_layers, len(block_ids), self.block_size, count, cfg.head_dim),
                           dtype=self.kv_cache.dtype, device=self.device)
        chunks = None
        if kv is not None:
            chunks = [kv[..., s : s + n, :] for s, n in map(self._heads_of, range(self.group.size))]
        super().write_blocks(block_ids, self.group.scatter(mine, chunks))

    def _read_full(self, block_ids: list[int]) -> torch.Tensor:
        if self.plan.tp_size == 1:  # EP only: rank 0 holds every head already
            return super().read_blocks(block_ids)
        parts = self.group.all_gather(super().read_blocks(block_ids))  # tp x (2, L, nb, bs, Hkv_local, hd)
        heads: dict[int, torch.Tensor] = {}
        for rank, part in enumerate(parts):  # replicated heads (Hkv < tp) are taken once
            first, count = self._heads_of(rank)
            for h in range(count):
                heads.setdefault(first + h, part[..., h : h + 1, :])
        return torch.cat([heads[h] for h in range(self.plan.cfg.num_kv_heads)], dim=-2)

    def _all_ok(self, work: Callable[[], object], what: str) -> None:
        """Run this rank's part, then agree with the others on whether every rank succeeded."""
        failed = 0
        try:
            work()
        except Exception as exc:  # this rank's transfer failed: report it, keep the group
            failed, self.last_local_error = 1, exc
        count = torch.tensor([failed], dtype=torch.long, device=self.device)
        total = int(self.group.all_reduce(count).item())
        self.group.check()
        if total and self.is_leader:  # a follower just goes on
            raise LocalKVFailed(f"{int(count.item())} rank(s) failed to {what} their KV heads")


def _request_args(request_id: str, num_tokens: int, block_ids: list[int], peer: str) -> list[int]:
    """[num_tokens, len(id), id bytes..., len(peer), peer bytes..., block ids...] (UTF-8 bytes)."""
    rid, who = list(request_id.encode("utf-8")), list(peer.encode("utf-8"))
    return [num_tokens, len(rid), *rid, len(who), *who, *block_ids]


def _parse_request_args(args: list[int]) -> tuple[str, int, list[int], str]:
    n, k = args[0], args[1]
    p = args[2 + k]
    rid, peer = bytes(args[2 : 2 + k]).decode("utf-8"), bytes(args[3 + k : 3 + k + p]).decode("utf-8")
    return rid, n, args[3 + k + p :], peer


def agree_num_blocks(group: Group, num_blocks: int, device: torch.device) -> int:
    """Every rank's pool must have the same blocks (rank 0 allocates for all): the smallest."""
    t = torch.tensor([num_blocks], dtype=torch.long, device=device)
    return int(group.all_reduce(t, dist.ReduceOp.MIN).item())
