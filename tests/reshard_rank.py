"""One rank of a prefill or decode group for the heterogeneous-TP transfer tests
(tests/integration/test_reshard.py), run as its own process. Argument: one JSON object.

prefill: prefills every prompt (greedy: the first token), then each rank sends its KV heads of the
  request straight to the decode ranks reshard.plan assigns (rank 0 from read_local, the
  others from their send_local hook); rank 0 writes the first tokens to `first_out`.
decode: each rank hosts a TransferServer (address written to addr_dir/rank<r>.json), accepts
  the pairs its pieces come over, receives them in parallel and places them into its heads;
  rank 0 reserves blocks, has every rank write its heads (write_local), admits the request
  with the prefill's first token and decodes; it writes the final tokens to `out`.
"""
from __future__ import annotations

import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from support import wait_for  # tests/ is on the path: this script's own folder

from engine import CacheConfig, EngineConfig, LLMEngine, Role, SamplingParams, SchedulerConfig
from engine.parallel import ParallelConfig
from kv_transfer import KVLayout, TransferConfig, TransferServer, connect
from kv_transfer.reshard import cut, header_shard, pieces_from, pieces_to, place, shard_of

TRANSFER = TransferConfig(backend="gloo", timeout_s=60.0, connect_timeout_s=60.0)


def write_atomic(path: Path, value) -> None:
    tmp = path.with_name("." + path.name)
    tmp.write_text(json.dumps(value))
    tmp.rename(path)


def wait_file(path: Path, key: str | None = None, timeout_s: float = 120.0):
    """The JSON in `path` once it exists (and holds `key`)."""
    def ready():
        if path.exists():
            value = json.loads(path.read_text())
            if key is None or key in value:
                return value
        return None
    return wait_for(ready, timeout_s, f"{path} written" + (f" with {key!r}" if key else ""), 0.05)


def build(args: dict, role: Role) -> tuple[LLMEngine, ParallelConfig]:
    torch.set_num_threads(1)
    parallel = ParallelConfig(**args["parallel"])
    engine = LLMEngine(EngineConfig(model=args["model"], dtype="float32", device="cpu", role=role,
                                    parallel=parallel, cache=CacheConfig(num_blocks=128, block_size=4),
                                    scheduler=SchedulerConfig(max_num_batched_tokens=256)))
    return engine, parallel


def ticket_of(piece) -> str:
    """The ticket of one sending rank's pair with one receiving rank (a router would make it)."""
    return f"reshard-pair-src{piece.src_rank}-dst{piece.dst_rank}"


def layout_of(engine: LLMEngine) -> KVLayout:
    return KVLayout.of_model(engine.model_id, engine.runner.kv_cache, engine.model_config.num_kv_heads)


def prefill(args: dict) -> None:
    engine, par = build(args, Role.PREFILL)
    heads, src_tp, dst_tp = engine.model_config.num_kv_heads, par.tp_size, args["dst_tp"]
    mine = shard_of(heads, src_tp, par.rank)
    channels = []
    for piece in pieces_from(heads, src_tp, par.rank, dst_tp):
        addr = wait_file(Path(args["addr_dir"]) / f"rank{piece.dst_rank}.json")
        channels.append((piece, connect(tuple(addr), layout_of(engine), TRANSFER, f"src{par.rank}",
                                        piece.sender_shard(src_tp), ticket=ticket_of(piece))))

    def send(request_id: str, num_tokens: int, kv: torch.Tensor, peer: str = "") -> None:
        for piece, channel in channels:
            channel.send(request_id, cut(kv, mine, piece), num_tokens)

    runner = engine.runner
    if par.rank != 0:
        runner.send_local = send
        runner.follow()
        return
    first = {}
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    for i, prompt in enumerate(args["prompts"]):
        rid = f"r{i}"
        engine.add_request(rid, prompt, params)
        while rid not in engine.prefilled:
            engine.step()
        seq = engine.prefilled[rid]
        blocks = seq.block_table[: math.ceil(seq.num_computed / engine.block_size)]
        kv = (runner.read_local(rid, seq.num_computed, blocks) if par.world_size > 1
              else runner.read_blocks(blocks))
        send(rid, seq.num_computed, kv)
        first[rid] = seq.token_ids[-1]
        engine.release(rid)
        write_atomic(Path(args["first_out"]), first)
    if par.world_size > 1:
        runner.stop_followers()


def decode(args: dict) -> None:
    engine, par = build(args, Role.DECODE)
    heads, src_tp, dst_tp = engine.model_config.num_kv_heads, args["src_tp"], par.tp_size
    mine = shard_of(heads, dst_tp, par.rank)
    server = TransferServer(TRANSFER)
    write_atomic(Path(args["addr_dir"]) / f"rank{par.rank}.json", list(server.address))
    channels = [server.accept(layout_of(engine), mine, ticket=ticket_of(piece))
                for piece in pieces_to(heads, src_tp, dst_tp, par.rank)]
    pool = ThreadPoolExecutor(len(channels))  # every pair at once: senders block until their ack
    kv_cache = engine.runner.kv_cache

    def receive(request_id: str, num_tokens: int, peer: str = "") -> torch.Tensor:
        nb = math.ceil(num_tokens / engine.block_size)
        out = torch.empty((2, kv_cache.shape[1], nb, *kv_cache.shape[3:]), dtype=kv_cache.dtype)
        for header, payload in pool.map(lambda ch: ch.receive(), channels):
            assert (header.request_id, header.num_tokens) == (request_id, num_tokens), header
            place(out, mine, header_shard(header), payload)
        return out

    runner = engine.runner
    if par.rank != 0:
        runner.receive_local = receive
        runner.follow()
        return
    params = SamplingParams(temperature=0.0, max_tokens=args["max_tokens"], ignore_eos=True)
    tokens = {}
    for i, prompt in enumerate(args["prompts"]):
        rid = f"r{i}"
        kv = receive(rid, len(prompt))
        blocks = engine.reserve(rid, len(prompt))
        if par.world_size > 1:
            runner.write_local(rid, len(prompt), blocks, kv)
        else:
            engine.write_kv(blocks, kv)
        first = wait_file(Path(args["first_out"]), rid)[rid]
        engine.admit(rid, prompt, first, params)
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    tokens[rid] = out.token_ids
    if par.world_size > 1:
        runner.stop_followers()
    Path(args["out"]).write_text(json.dumps([tokens[f"r{i}"] for i in range(len(args["prompts"]))]))


if __name__ == "__main__":
    import faulthandler

    args = json.loads(sys.argv[1])
    faulthandler.dump_traceback_later(80, exit=True)  # a hung rank shows where, before the test kills it
    (prefill if args["role"] == "prefill" else decode)(args)
