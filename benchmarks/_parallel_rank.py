"""One process of benchmarks/parallel_bench.py (not a benchmark itself). Argument: one JSON object.

mode "step": one rank of an engine of TP size `tp`; rank 0 times decode steps at each batch
  size and writes {batch: {"step_s": [...], "comm_s": [...]}} to `out`.
mode "send" / "recv": the two ends of a heterogeneous-TP KV transfer (kv_transfer.reshard):
  one TP=1 sender, `dst_tp` receiver ranks each taking its heads; every process writes the
  wall-clock time of each rep's start (sender) or end (receiver) to `out`.
"""
from __future__ import annotations

import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.model_config import ModelConfig
from engine.parallel import ParallelConfig
from engine.presets import resolve_model
from kv_transfer import KVLayout, TransferConfig, TransferServer, connect
from kv_transfer.reshard import cut, header_shard, pieces_from, pieces_to, place, shard_of

TRANSFER = TransferConfig(backend="gloo", timeout_s=120.0, connect_timeout_s=120.0)


def step(a: dict) -> None:
    torch.set_num_threads(a["threads"])
    parallel = ParallelConfig(tp_size=a["tp"], rank=a["rank"], rendezvous=a["rendezvous"], timeout_s=120)
    engine = LLMEngine(EngineConfig(
        model=a["model"], dtype="float32", device="cpu", num_threads=a["threads"], parallel=parallel,
        cache=CacheConfig(num_blocks=a["num_blocks"], block_size=16, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=4096)))
    runner, group = engine.runner, getattr(engine.runner, "group", None)
    if a["rank"] != 0:
        runner.follow()
        return
    result = {}
    g = torch.Generator().manual_seed(0)
    for batch in a["batches"]:
        params = SamplingParams(temperature=0.0, max_tokens=a["warmup"] + a["steps"] + 4, ignore_eos=True)
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", torch.randint(3, 1000, (a["prompt_len"],), generator=g).tolist(),
                               params)
        started: set[str] = set()
        while len(started) < batch:  # prefill everything: from here every step is a pure decode step
            started |= {o.request_id for o in engine.step()}
        steps, comm = [], []
        for k in range(a["warmup"] + a["steps"]):
            c0, t0 = group.comm_s if group else 0.0, time.perf_counter()
            engine.step()
            if k >= a["warmup"]:
                steps.append(time.perf_counter() - t0)
                comm.append((group.comm_s if group else 0.0) - c0)
        for i in range(batch):
            engine.abort(f"b{batch}-{i}")
        result[str(batch)] = {"step_s": steps, "comm_s": comm}
    if group:
        runner.stop_followers()
    Path(a["out"]).write_text(json.dumps(result))


def layout(a: dict) -> KVLayout:
    cfg = ModelConfig.from_dir(resolve_model(a["model"]))
    return KVLayout(a["model"], cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 16, torch.float32)


def send(a: dict) -> None:
    torch.set_num_threads(1)
    lay = layout(a)
    nb = math.ceil(a["tokens"] / lay.block_size)
    kv = torch.randn(2, lay.num_layers, nb, lay.block_size, lay.num_kv_heads, lay.head_dim)
    held = shard_of(lay.num_kv_heads, 1, 0)
    channels = []
    for piece in pieces_from(lay.num_kv_heads, 1, 0, a["dst_tp"]):
        addr = json.loads(_wait(Path(a["dir"]) / f"rank{piece.dst_rank}.json").read_text())
        channels.append((piece, connect(tuple(addr), lay, TRANSFER, "src0", piece.sender_shard(1),
                                        ticket=f"bench-pair-to-rank{piece.dst_rank}")))
    starts = []
    with ThreadPoolExecutor(len(channels)) as pool:  # one pair per decode rank, all at once
        for rep in range(a["reps"]):
            time.sleep(0.3)  # the receivers finished the previous rep and wait in recv_header
            starts.append(time.time())
            rid = f"rep{rep}"
            list(pool.map(lambda pc, rid=rid: pc[1].send(rid, cut(kv, held, pc[0]), a["tokens"]), channels))
    Path(a["out"]).write_text(json.dumps(starts))


def recv(a: dict) -> None:
    torch.set_num_threads(1)
    lay = layout(a)
    mine = shard_of(lay.num_kv_heads, a["dst_tp"], a["rank"])
    server = TransferServer(TRANSFER)
    tmp = Path(a["dir"]) / f".rank{a['rank']}.json"
    tmp.write_text(json.dumps(list(server.address)))
    tmp.rename(Path(a["dir"]) / f"rank{a['rank']}.json")
    channels = [server.accept(lay, mine, ticket=f"bench-pair-to-rank{piece.dst_rank}")
                for piece in pieces_to(lay.num_kv_heads, 1, a["dst_tp"], a["rank"])]
    nb = math.ceil(a["tokens"] / lay.block_size)
    pool_kv = torch.zeros(2, lay.num_layers, 4 * nb, lay.block_size, mine.head_count, lay.head_dim)
    out = torch.empty(2, lay.num_layers, nb, lay.block_size, mine.head_count, lay.head_dim)
    ends = []
    with ThreadPoolExecutor(len(channels)) as pool:
        for _ in range(a["reps"]):
            for header, payload in pool.map(lambda ch: ch.receive(), channels):
                place(out, mine, header_shard(header), payload)
            pool_kv[:, :, nb : 2 * nb].copy_(out)  # into the pool's blocks, as write_kv does
            ends.append(time.time())
    Path(a["out"]).write_text(json.dumps(ends))


def _wait(path: Path, timeout_s: float = 120.0) -> Path:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)
    return path


if __name__ == "__main__":
    args = json.loads(sys.argv[1])
    {"step": step, "send": send, "recv": recv}[args["mode"]](args)
