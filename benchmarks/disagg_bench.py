"""Disaggregation benchmark: what splitting prefill from decode costs and what it buys.

Four ratios, all measured in ONE run on SmolLM2-135M-Instruct (`smollm2-135m`: Llama, 30 layers,
hidden 576, 9/3 heads, head_dim 64, vocab 49,152; real weights, pulled and converted on first use)
in float32; `--model bench` (Qwen3: hidden 512, 8 layers, 8/2 heads; random weights, no download)
or `--model tiny` runs a preset. Each compares against a baseline taken in the same run, on the
same cores, so it stays meaningful across machines:

  transfer_vs_raw_gloo          (target >= 0.7)
      KV transfer throughput for a 1,024-token prompt (SmolLM2: 30 layers x 3 KV heads x 64 x fp32
      x K+V = 45 KiB/token, 45 MiB; `bench`: 8 KiB/token) divided by a plain torch.distributed gloo
      send/recv of the same byte count between the SAME two processes over the SAME process group
      (the channel's `link.data`).
      Two spawned processes (not Ray actors: gloo between spawned processes is ~2x faster here, and
      the comparison needs only that both paths share the pair), one torch thread each:
        A: prefill-role LLMEngine, `kv_transfer.connect` (sender);
        B: decode-role LLMEngine, `TransferServer` (receiver).
      Per rep, A prefills a fresh 1,024-token prompt and exports its KV (as PrefillWorker does
      when the first token exists); both meet at a gloo barrier; then
        ours: A channel.send; B recv_header, reserve, recv_payload into a reused buffer (ack,
              payload, checksum), write_kv. Timed on B from the barrier to write_kv done.
        raw:  A raw_send / B raw_recv of a preallocated uint8 tensor of exactly the payload bytes,
              timed on B from the barrier to the receive done.
      (and, for the breakdown only, raw into a freshly allocated buffer, as recv_payload does).
      The three are interleaved rep by rep, so load drift hits them alike. Ratio =
      (bytes / median ours) / (bytes / median raw) = median raw / median ours. Raw holds every
      rep's seconds, B's phase breakdown, A's export/send split and the checksum cost alone.

  transfer_share_of_ttft        (target <= 0.15)
      In the real cluster (Ray; 1 prefill + 1 decode worker sharing 2 cores, 1 torch thread each),
      sequential 1,024-token requests (distinct random prompts: no prefix hits; max_tokens 2 so the
      KV does move), after warm-up requests: median over requests of transfer_s / ttft_s from the
      last chunk's Timing. Raw keeps the full TTFT breakdown per request: queue, prefill (the
      router's prefill RPC), transfer (the decode worker's receive of the KV the prefill worker
      sent as it exported it: header to KV written), the rest of the router's TTFT (reserve RPC,
      decode.generate start, admit, first chunk:
      no decode step runs before the first token, which the prefill produced), and the hop from the
      router to this driver (client TTFT - router TTFT). The engine's own prefill time (phase 1,
      same thread count, no Ray) is kept next to it.

  disagg_ttft_vs_engine         (target <= 1.1)
      What disaggregation adds to the time to first token: the cluster's TTFT (1 prefill + 1 decode
      worker, 1 torch thread each; seen by this driver) divided by the same prompt's on one bare
      LLMEngine in this process (mixed role, the same engine settings, 1 torch thread, no Ray, no
      router): add_request to the first token out of step(). The same sequential prompts as
      transfer_share_of_ttft; each prompt runs on the cluster, then on the engine, rep by rep, so
      load drift hits both alike. Median over requests of each, then the ratio. The first token
      leaves the router from the prefill result, so the KV transfer is not part of it.

  itl_p99_disagg_vs_colocated   (target <= 0.5)
      Inter-token latency p99 of running decodes while 2,048-token prompts keep arriving:
      disaggregated (prefill=1, decode=1, num_cpus=2: 1 core each) divided by colocated
      (mode=colocated, one mixed worker with 2 threads) on the same 2 cores. Workload per mode:
      4 decode streams (32-token prompts, greedy, ignore_eos, max_tokens large) reach steady state;
      a quiet window is recorded; then a 2,048-token prompt (max_tokens 4) is submitted every
      `interval` seconds; the measuring window runs from the first submission until the last long
      request finishes, then the decode streams are aborted. ITL = gap between arrival times of
      consecutive chunks of a decode stream, taken in this driver as it consumes the router's
      streams; gaps ending inside the window count. p99 over all gaps of all streams. Engine
      max_num_batched_tokens = 2048 (so a colocated prefill chunk is big, as deployed). Raw keeps
      p50/p90/p99/mean/max for both modes, the quiet-window ITL, every gap with its time, each long
      request's timing, and a batch-4 decode step of the bare engine at 1 and 2 threads (no Ray):
      quiet-window ITL minus that step is the cluster's per-token overhead. raw.<mode>.itl.cpu says
      where the cores went in each window (cores used per process: workers, router actor, this
      driver, raylet, ...; and cores stolen by other VMs).

Output: benchmarks/results/disagg_bench.json ({"machine", "ratios", "targets", "raw"}) and
disagg_bench.png (transfer vs raw gloo, TTFT breakdown, ITL CDF, ITL over time). --quick (a smoke
run, < 1 minute: fewer reps, 512-token transfer/TTFT prompts, one 1,024-token interfering prompt)
writes disagg_bench.quick.json/.png instead, so a smoke run never overwrites the full results.
A missed target prints MISS and still exits 0; a phase that crashes is recorded under raw.errors,
its ratio is n/a, and the exit status is 1.

Numbers are only meaningful on a quiet machine: every phase here uses both cores, and Ray's own
processes, the router and this driver share them too. raw.phase_cpu records, per phase, the load
average, the share of the CPUs used by every process other than this driver (our own workers
included, so it is high by design), and the cores each process used (cores_by_process: "ours:"
for this run's Ray daemons, workers and spawned processes, "other:" for everyone else's;
other_people_cores > 0.1 prints a WARNING: rerun then). Ray needs RAY_USAGE_STATS_ENABLED=0 and
RAY_AUTH_MODE=disabled on a laptop; this script sets both unless they are already set.
"""
from __future__ import annotations

import asyncio
import os
import queue
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


import numpy as np
import torch

from benchmarks import _common as C
from benchmarks.harness.cpu import cores_between, cpu_mark
from benchmarks.harness.run import BenchRun, bench_args
from engine import CacheConfig, EngineConfig, LLMEngine, Role, SamplingParams, SchedulerConfig

NAME = "disagg_bench"
TARGETS = {
    "transfer_vs_raw_gloo": ">= 0.7",
    "transfer_share_of_ttft": "<= 0.15",
    "disagg_ttft_vs_engine": "<= 1.1",
    "itl_p99_disagg_vs_colocated": "<= 0.5",
}
BLOCK_SIZE = 16
BENCH_TICKET = "disagg-bench-transfer-pair"  # the two phase processes' one pairing (a router would make it)
FIRST_ID = 3  # ids 0..2 are special tokens: keep prompts to ordinary ones
CORES = 2  # what the cluster phases give the workers (num_cpus), both modes alike


@dataclass(frozen=True)
class Plan:
    # 1. transfer vs raw gloo (two spawned processes)
    transfer_prompt_len: int = 1024
    transfer_warmup: int = 2
    transfer_reps: int = 12
    # 2. TTFT breakdown in the cluster
    ttft_prompt_len: int = 1024
    ttft_warmup: int = 2
    ttft_reps: int = 8
    # 3. ITL under arriving prefills
    itl_decodes: int = 4
    itl_decode_prompt_len: int = 32
    itl_decode_max_tokens: int = 3000  # more than the window needs: the streams are aborted after it
    itl_warm_chunks: int = 8  # every decode stream has this many chunks before the quiet window
    itl_quiet_s: float = 3.0
    itl_long_prompt_len: int = 2048
    itl_long_prompts: int = 4
    itl_long_max_tokens: int = 4
    itl_interval_s: float = 3.0
    # engine reference: a bare batch-4 decode step
    ref_steps: int = 32
    # every worker
    num_blocks: int = 2048  # 32k tokens of KV per worker (1.4 GiB on SmolLM2 in fp32): nothing is ever evicted
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64


FULL = Plan()
QUICK = Plan(transfer_prompt_len=512, transfer_warmup=1, transfer_reps=3, ttft_prompt_len=512, ttft_warmup=1,
             ttft_reps=2, itl_warm_chunks=4, itl_quiet_s=1.0, itl_long_prompt_len=1024, itl_long_prompts=1,
             itl_interval_s=1.0, ref_steps=8, num_blocks=512)


# -- helpers ---------------------------------------------------------------------------------
def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, size=n).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def engine_config(model: str, plan: Plan, role: Role, threads: int, num_blocks: int | None = None) -> EngineConfig:
    return EngineConfig(
        model=model, dtype="float32", role=role, num_threads=threads,
        cache=CacheConfig(num_blocks=num_blocks or plan.num_blocks, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_batched_tokens=plan.max_num_batched_tokens,
                                  max_num_seqs=plan.max_num_seqs))


def vocab_of(model: str) -> int:
    import json

    from engine.presets import resolve_model

    return int(json.loads((Path(resolve_model(model)) / "config.json").read_text())["vocab_size"])


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


# -- 1. KV transfer vs raw gloo, between two spawned processes -----------------------------------
def _sync(pg) -> None:
    """Both ranks leave together (a gloo barrier on the pair's own group)."""
    pg.barrier().wait()


def _transfer_proc(role: str, model: str, plan_d: dict, seed: int, addr_q, out_q) -> None:
    """Child process body. role 'decode' (rank 0, receiver, B) or 'prefill' (rank 1, sender, A)."""
    try:
        torch.set_num_threads(1)
        from kv_transfer import (
            KVLayout,
            TransferConfig,
            TransferServer,
            connect,
            payload_checksum,
            payload_view,
            raw_recv,
            raw_send,
        )

        plan = Plan(**plan_d)
        tcfg = TransferConfig(backend="gloo", timeout_s=300.0, connect_timeout_s=300.0)
        t0 = time.perf_counter()
        engine = LLMEngine(engine_config(model, plan, Role.DECODE if role == "decode" else Role.PREFILL, 1))
        load_s = time.perf_counter() - t0
        layout = KVLayout.from_kv_cache(engine.model_id, engine.runner.kv_cache)
        kv_bytes_per_token = engine.model_config.kv_bytes_per_token(engine.dtype)
        n_total = plan.transfer_warmup + plan.transfer_reps
        L = plan.transfer_prompt_len
        nbytes = -(-L // BLOCK_SIZE) * BLOCK_SIZE * kv_bytes_per_token
        out: dict = {"role": role, "pid": os.getpid(), "engine_load_s": load_s,
                     "torch_threads": torch.get_num_threads()}

        if role == "decode":
            server = TransferServer(tcfg)
            out_q.put(("addr", server.address))
            ch = server.accept(layout, ticket=BENCH_TICKET)
            pg = ch.link.data
            raw_buf = torch.zeros(nbytes, dtype=torch.uint8)
            recv_buf = torch.zeros(nbytes, dtype=torch.uint8)
            rec = {k: [] for k in ("ours_s", "header_wait_s", "reserve_s", "payload_s", "write_kv_s",
                                   "checksum_s", "raw_s", "raw_fresh_s", "payload_bytes")}
            for rep in range(n_total):
                _sync(pg)
                t0 = time.perf_counter()
                header = ch.recv_header()
                t1 = time.perf_counter()
                blocks = engine.reserve(header.request_id, header.num_tokens)
                t2 = time.perf_counter()
                kv = ch.recv_payload(header, payload_view(recv_buf, header))  # reused, as DecodeWorker does
                t3 = time.perf_counter()
                engine.write_kv(blocks, kv)
                t4 = time.perf_counter()
                engine.abort(header.request_id)  # frees the reservation (never admitted)
                tc = time.perf_counter()
                payload_checksum(kv)
                checksum_s = time.perf_counter() - tc
                del kv
                _sync(pg)
                t5 = time.perf_counter()
                raw_recv(pg, raw_buf, 300.0)
                raw_s = time.perf_counter() - t5
                _sync(pg)
                t6 = time.perf_counter()
                fresh = torch.empty(header.payload_nbytes, dtype=torch.uint8)
                raw_recv(pg, fresh, 300.0)
                raw_fresh_s = time.perf_counter() - t6
                del fresh
                if rep >= plan.transfer_warmup:
                    for k, v in (("ours_s", t4 - t0), ("header_wait_s", t1 - t0), ("reserve_s", t2 - t1),
                                 ("payload_s", t3 - t2), ("write_kv_s", t4 - t3), ("checksum_s", checksum_s),
                                 ("raw_s", raw_s), ("raw_fresh_s", raw_fresh_s),
                                 ("payload_bytes", header.payload_nbytes)):
                        rec[k].append(v)
                out_q.put(("progress", role))
            out.update(rec)
            out["payload_shape"] = list(header.payload_shape)
            ch.close()
            server.close()
        else:
            host, port = addr_q.get(timeout=300)
            ch = connect((host, port), layout, tcfg, name="bench-prefill", ticket=BENCH_TICKET)
            pg = ch.link.data
            raw_buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
            rng = np.random.default_rng(seed + 101)
            vocab = engine.model_config.vocab_size
            rec = {k: [] for k in ("prefill_s", "export_s", "send_s", "checksum_s", "raw_send_s")}
            for rep in range(n_total):
                rid = f"xfer-{rep}"
                t0 = time.perf_counter()
                engine.add_request(rid, random_ids(rng, L, vocab), greedy(2))
                while rid not in engine.prefilled:
                    engine.step()
                prefill_s = time.perf_counter() - t0
                # As PrefillWorker does: the KV is copied out when the first token exists, so the
                # transfer starts from the exported copy.
                t0 = time.perf_counter()
                export = engine.export_kv(rid)
                t1 = time.perf_counter()
                _sync(pg)
                ch.send(export.request_id, export.kv, export.num_tokens)
                t2 = time.perf_counter()
                tc = time.perf_counter()
                payload_checksum(export.kv.contiguous())
                checksum_s = time.perf_counter() - tc
                _sync(pg)
                t3 = time.perf_counter()
                raw_send(pg, raw_buf, 300.0)
                raw_send_s = time.perf_counter() - t3
                _sync(pg)
                raw_send(pg, raw_buf, 300.0)
                if rep >= plan.transfer_warmup:
                    for k, v in (("prefill_s", prefill_s), ("export_s", t1 - t0), ("send_s", t2 - t1),
                                 ("checksum_s", checksum_s), ("raw_send_s", raw_send_s)):
                        rec[k].append(v)
                out_q.put(("progress", role))
            out.update(rec)
            ch.close()
        out_q.put(("result", role, out))
    except BaseException:
        out_q.put(("error", role, traceback.format_exc()))


def phase_transfer(plan: Plan, model: str, seed: int, show: bool) -> dict:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    addr_q, out_q = ctx.Queue(), ctx.Queue()
    procs = {role: ctx.Process(target=_transfer_proc, args=(role, model, asdict(plan), seed, addr_q, out_q),
                               name=f"disagg-bench-{role}", daemon=True)
             for role in ("decode", "prefill")}
    for p in procs.values():
        p.start()
    results: dict[str, dict] = {}
    n = plan.transfer_warmup + plan.transfer_reps
    deadline = time.monotonic() + 600
    try:
        with C.progress(f"KV transfer vs raw gloo, {plan.transfer_prompt_len}-token prompts "
                        f"({plan.transfer_warmup} warm-up)", n, show) as advance:
            while len(results) < 2:
                if time.monotonic() > deadline:
                    raise TimeoutError("transfer processes did not finish within 600 s")
                try:
                    msg = out_q.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r, p in procs.items() if not p.is_alive() and r not in results]
                    if dead and out_q.empty():
                        raise RuntimeError(f"transfer process(es) {dead} exited without a result") from None
                    continue
                if msg[0] == "addr":
                    addr_q.put(msg[1])
                elif msg[0] == "progress" and msg[1] == "decode":
                    advance()
                elif msg[0] == "result":
                    results[msg[1]] = msg[2]
                elif msg[0] == "error":
                    raise RuntimeError(f"transfer process {msg[1]} failed:\n{msg[2]}")
    finally:
        for p in procs.values():
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    rx, tx = results["decode"], results["prefill"]
    nbytes = rx["payload_bytes"][0]
    ours, raw = med(rx["ours_s"]), med(rx["raw_s"])
    breakdown = {k: med(rx[k]) for k in ("header_wait_s", "reserve_s", "payload_s", "write_kv_s")}
    after_header = [o - h for o, h in zip(rx["ours_s"], rx["header_wait_s"])]
    return {
        "prompt_len": plan.transfer_prompt_len, "reps": plan.transfer_reps, "warmup": plan.transfer_warmup,
        "transport": "gloo over tcp 127.0.0.1, two multiprocessing-spawn processes, 1 torch thread each",
        "payload_bytes": nbytes, "payload_shape": rx["payload_shape"],
        "ours_median_s": ours, "raw_median_s": raw, "raw_fresh_median_s": med(rx["raw_fresh_s"]),
        "ours_bytes_per_s": nbytes / ours, "raw_bytes_per_s": nbytes / raw,
        "raw_fresh_bytes_per_s": nbytes / med(rx["raw_fresh_s"]),
        "ours_stats_s": C.summarize(rx["ours_s"]), "raw_stats_s": C.summarize(rx["raw_s"]),
        "receiver_breakdown_median_s": breakdown,
        # The same ratio with the clock started when the header has arrived (leaves out the sender's
        # checksum and the header's trip): how much of the gap is the receiver's.
        "after_header_median_s": med(after_header),
        "ratio_after_header": raw / med(after_header),
        "receiver_checksum_alone_median_s": med(rx["checksum_s"]),
        "sender_export_median_s": med(tx["export_s"]), "sender_send_median_s": med(tx["send_s"]),
        "sender_checksum_alone_median_s": med(tx["checksum_s"]),
        "engine_prefill_1thread_median_s": med(tx["prefill_s"]),
        "receiver": rx, "sender": tx,
        "notes": "ours = receiver's barrier -> write_kv done: includes the sender's checksum "
                 "(header_wait; the export_kv copy happens before the barrier, as in PrefillWorker), "
                 "the header/ack round trip, the payload, the receiver's checksum "
                 "(payload) and the block scatter (write_kv). raw = the same byte count over the same "
                 "process group into a preallocated buffer; raw_fresh = into a new torch.empty buffer "
                 "(page faults), as recv_payload(out=None) does.",
    }


# -- engine reference: a bare batch-4 decode step ------------------------------------------------
def phase_engine_reference(plan: Plan, model: str, seed: int) -> dict:
    n = plan.itl_decodes
    steps = plan.ref_steps
    max_tokens = 2 * steps + 32
    need = -(-(plan.itl_decode_prompt_len + max_tokens) // BLOCK_SIZE)
    engine = LLMEngine(engine_config(model, plan, Role.MIXED, 1, num_blocks=n * need + 8))
    rng = np.random.default_rng(seed + 7)
    vocab = engine.model_config.vocab_size
    for i in range(n):
        engine.add_request(f"ref-{i}", random_ids(rng, plan.itl_decode_prompt_len, vocab), greedy(max_tokens))
    while any(not engine.seqs[f"ref-{i}"].token_ids[plan.itl_decode_prompt_len:] for i in range(n)):
        engine.step()
    out = {"batch": n, "steps": steps}
    prev = torch.get_num_threads()
    for threads in (1, CORES):
        torch.set_num_threads(threads)
        for _ in range(4):
            engine.step()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        out[f"step_{threads}thread_median_s"] = statistics.median(times)
        out[f"step_{threads}thread_s"] = times
    torch.set_num_threads(prev)
    return out


# -- cluster plumbing ------------------------------------------------------------------------------
def cluster_config(model: str, plan: Plan, mode: str):
    from cluster.config import ClusterConfig

    return ClusterConfig(
        model=model, mode=mode, prefill=1, decode=1, num_cpus=CORES,
        engine={"dtype": "float32", "cache": {"block_size": BLOCK_SIZE, "num_blocks": plan.num_blocks},
                "scheduler": {"max_num_batched_tokens": plan.max_num_batched_tokens,
                              "max_num_seqs": plan.max_num_seqs}})


async def consume(cl, req, rec: dict) -> dict:
    """Drive one request through the router, recording each chunk's arrival here (perf_counter)."""
    rec.update(submit=time.perf_counter(), arrivals=[], tokens=[], last=None)
    async for ref in cl.router.generate.remote(req):
        chunk = await ref
        rec["arrivals"].append(time.perf_counter())
        rec["tokens"].append(len(chunk.token_ids))
        if chunk.finished:
            rec["last"] = chunk
    return rec


def timing_of(rec: dict) -> dict:
    last = rec["last"]
    t = last.timing if last is not None else None
    first_arrival = next((a for a, n in zip(rec["arrivals"], rec["tokens"]) if n), None)
    out = {"finish_reason": last.finish_reason if last else None,
           "client_ttft_s": first_arrival - rec["submit"] if first_arrival else None,
           "client_total_s": rec["arrivals"][-1] - rec["submit"] if rec["arrivals"] else None,
           "tokens": sum(rec["tokens"]), "chunks": len(rec["tokens"])}
    if t is not None:
        out.update(queue_s=t.queue_s, prefill_s=t.prefill_s, transfer_s=t.transfer_s,
                   transfer_bytes=t.transfer_bytes, ttft_s=t.ttft_s, total_s=t.total_s, recomputed=t.recomputed,
                   prefill_worker=last.prefill_worker, decode_worker=last.decode_worker)
    return out


# -- 2. TTFT breakdown ------------------------------------------------------------------------------
def engine_ttft(engine: LLMEngine, rid: str, prompt: list[int]) -> float:
    """Seconds from add_request to the first token on a bare engine (no Ray, no router)."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, greedy(2))
    while not any(o.request_id == rid and o.new_token_ids for o in engine.step()):
        pass
    ttft = time.perf_counter() - start
    engine.abort(rid)
    return ttft


async def run_ttft(cl, plan: Plan, model: str, vocab: int, seed: int, show: bool) -> dict:
    from engine.messages import GenerateRequest

    rng = np.random.default_rng(seed + 202)
    L = plan.ttft_prompt_len
    reqs, warm = [], []
    # The baseline of disagg_ttft_vs_engine: one engine with the workers' settings and thread count.
    engine = LLMEngine(engine_config(model, plan, Role.MIXED, 1))
    with C.progress(f"TTFT, sequential {L}-token prompts ({plan.ttft_warmup} warm-up), cluster then engine",
                    plan.ttft_warmup + plan.ttft_reps, show) as advance:
        for i in range(plan.ttft_warmup + plan.ttft_reps):
            prompt = random_ids(rng, L, vocab)
            rec = await consume(cl, GenerateRequest(f"ttft-{i}", prompt, greedy(2)), {})
            r = timing_of(rec)
            r["engine_ttft_s"] = engine_ttft(engine, f"engine-ttft-{i}", prompt)
            (warm if i < plan.ttft_warmup else reqs).append(r)
            advance()
    engine.close()
    for r in reqs:
        r["share"] = r["transfer_s"] / r["ttft_s"]
        r["router_rest_s"] = r["ttft_s"] - r["queue_s"] - r["prefill_s"] - r["transfer_s"]
        r["driver_hop_s"] = r["client_ttft_s"] - r["ttft_s"]
    keys = ("queue_s", "prefill_s", "transfer_s", "router_rest_s", "driver_hop_s", "ttft_s", "client_ttft_s",
            "share", "engine_ttft_s")
    return {
        "prompt_len": L, "reps": plan.ttft_reps, "warmup": plan.ttft_warmup, "max_tokens": 2,
        "requests": reqs, "warmup_requests": warm,
        "median": {k: med([r[k] for r in reqs]) for k in keys},
        "share_of_medians": med([r["transfer_s"] for r in reqs]) / med([r["ttft_s"] for r in reqs]),
        "vs_engine": med([r["client_ttft_s"] for r in reqs]) / med([r["engine_ttft_s"] for r in reqs]),
        "router_ttft_vs_engine": med([r["ttft_s"] for r in reqs]) / med([r["engine_ttft_s"] for r in reqs]),
        "any_recomputed": any(r["recomputed"] for r in reqs),
        "transfer_bytes": sorted({r["transfer_bytes"] for r in reqs}),
        "breakdown_doc": {
            "queue_s": "router admission (Timing.queue_s)",
            "prefill_s": "router: prefill RPC to the prefill worker, first token back (engine prefill + Ray hop)",
            "transfer_s": "decode worker: the KV's header arriving (sent as it was exported) to write_kv done",
            "router_rest_s": "ttft - queue - prefill - transfer (negative: the first token leaves from the "
                             "prefill result, so the transfer overlaps the stream after it): reserve RPC, "
                             "picking, the first chunk's hop",
            "engine_ttft_s": "the same prompt on one bare engine in this driver (1 thread): add_request to "
                             "the first token",
            "driver_hop_s": "client TTFT (driver submit -> first chunk here) - router TTFT: driver <-> router "
                            "actor hops"},
    }


# -- 3. ITL while long prompts arrive -------------------------------------------------------------
async def run_itl(cl, plan: Plan, mode: str, vocab: int, seed: int, show: bool) -> dict:
    from engine.messages import GenerateRequest

    rng = np.random.default_rng(seed + (303 if mode == "disaggregated" else 404))
    dec_recs = [{} for _ in range(plan.itl_decodes)]
    dec_ids = [f"{mode}-dec-{i}" for i in range(plan.itl_decodes)]
    dec_tasks = [asyncio.create_task(consume(cl, GenerateRequest(
        rid, random_ids(rng, plan.itl_decode_prompt_len, vocab), greedy(plan.itl_decode_max_tokens)), rec))
        for rid, rec in zip(dec_ids, dec_recs)]
    t_wait = time.perf_counter()
    while min(len(r.get("arrivals", ())) for r in dec_recs) < plan.itl_warm_chunks:
        if time.perf_counter() - t_wait > 120:
            raise TimeoutError(f"{mode}: decode streams did not start within 120 s")
        if any(t.done() for t in dec_tasks):
            for t in dec_tasks:
                if t.done() and t.exception():
                    raise t.exception()
        await asyncio.sleep(0.02)
    snaps = [cpu_mark()]
    quiet_start = time.perf_counter()
    await asyncio.sleep(plan.itl_quiet_s)
    snaps.append(cpu_mark())
    win_start = time.perf_counter()
    long_recs = [{} for _ in range(plan.itl_long_prompts)]
    long_tasks, submits = [], []
    with C.progress(f"ITL {mode}: {plan.itl_long_prompts} x {plan.itl_long_prompt_len}-token prompts "
                    f"every {plan.itl_interval_s:g} s", plan.itl_long_prompts, show) as advance:
        for i, rec in enumerate(long_recs):
            await asyncio.sleep(max(0.0, win_start + i * plan.itl_interval_s - time.perf_counter()))
            submits.append(time.perf_counter() - win_start)
            task = asyncio.create_task(consume(cl, GenerateRequest(
                f"{mode}-long-{i}", random_ids(rng, plan.itl_long_prompt_len, vocab),
                greedy(plan.itl_long_max_tokens)), rec))
            task.add_done_callback(lambda _: advance())
            long_tasks.append(task)
        await asyncio.gather(*long_tasks)
    win_end = time.perf_counter()
    snaps.append(cpu_mark())
    cpu = {"quiet": cores_between(snaps[0], snaps[1]), "window": cores_between(snaps[1], snaps[2])}
    streams_alive = [not t.done() for t in dec_tasks]
    for rid in dec_ids:
        await cl.router.abort.remote(rid)
    await asyncio.wait_for(asyncio.gather(*dec_tasks, return_exceptions=True), 60)

    window, quiet, series, multi = [], [], [], 0
    for rec in dec_recs:
        arr = [a for a, n in zip(rec["arrivals"], rec["tokens"]) if n]  # the abort chunk has no tokens
        multi += sum(n > 1 for n in rec["tokens"])
        for a, b in zip(arr, arr[1:]):
            if win_start <= b <= win_end:
                window.append(b - a)
                series.append((b - win_start, b - a))
            elif quiet_start <= b < win_start:
                quiet.append(b - a)
    series.sort()
    return {
        "mode": mode, "decode_streams": plan.itl_decodes, "window_s": win_end - win_start,
        "quiet_window_s": win_start - quiet_start, "long_submit_s": submits,
        "itl_window_s": C.latency_stats(window), "itl_quiet_s": C.latency_stats(quiet),
        "gaps_window_s": window, "gaps_quiet_s": quiet,
        "gap_series": [[round(t, 6), round(g, 6)] for t, g in series],
        "chunks_with_more_than_one_token": multi,
        "decode_streams_alive_through_window": all(streams_alive),
        "long_requests": [dict(timing_of(r), finish_offset_s=r["arrivals"][-1] - win_start) for r in long_recs],
        "decode_tokens": [sum(r["tokens"]) for r in dec_recs],
        # Cores each process used (CPU s / wall s) and cores stolen by other VMs, per window:
        # where the 2 cores went (workers, router actor, this driver, raylet, ...).
        "cpu": cpu,
    }


def phase_cluster(plan: Plan, model: str, mode: str, seed: int, show: bool, with_ttft: bool) -> dict:
    from cluster.launch import launch

    cfg = cluster_config(model, plan, mode)
    vocab = vocab_of(model)
    t0 = time.perf_counter()
    cl = launch(cfg)
    launch_s = time.perf_counter() - t0
    out: dict = {"launch_s": launch_s, "config": cfg.model_dump(mode="json")}
    try:
        async def body():
            if with_ttft:
                out["ttft"] = await run_ttft(cl, plan, model, vocab, seed, show)
            out["itl"] = await run_itl(cl, plan, mode, vocab, seed, show)
        asyncio.run(body())
        out["worker_stats_after"] = cl.stats()
    finally:
        cl.shutdown()
    return out


# -- plot ---------------------------------------------------------------------------------------
def plot(ratios: dict, raw: dict):
    title = (f"Brigade disaggregation bench ({raw['model']}, float32, {CORES} cores"
             f"{', QUICK' if raw['quick'] else ''})")
    fig, (ax_x, ax_t, ax_cdf, ax_ts) = C.new_figure(4, title, width_per_panel=4.4, height=4.4)

    x = raw.get("transfer")
    if x:
        ms = 1e3
        bd = x["receiver_breakdown_median_s"]
        raw_b = x["raw_median_s"] * ms
        fresh_b = x["raw_fresh_median_s"] * ms
        ax_x.bar(["raw gloo", "raw gloo\nfresh buf"], [raw_b, fresh_b], color=["tab:gray", "tab:olive"])
        bottom = 0.0
        for part, color, label in (("header_wait_s", "#fdae6b", "export+checksum+header"),
                                   ("reserve_s", "#e6550d", "reserve"),
                                   ("payload_s", "#1f77b4", "ack+payload+checksum"),
                                   ("write_kv_s", "#6baed6", "write_kv")):
            h = bd[part] * ms
            ax_x.bar(["ours"], [h], bottom=bottom, color=color, label=label)
            bottom += h
        # The stack is the sum of per-phase medians; the label gives the median of the whole (the ratio's).
        ours_ms = x["ours_median_s"] * ms
        for lbl, v, top in (("raw gloo", raw_b, raw_b), ("raw gloo\nfresh buf", fresh_b, fresh_b),
                            ("ours", ours_ms, bottom)):
            ax_x.annotate(f"{v:.1f} ms\n{x['payload_bytes'] / (v / ms) / 1e9:.2f} GB/s", (lbl, top), ha="center",
                          va="bottom", fontsize=7, xytext=(0, 2), textcoords="offset points")
        ax_x.set_ylabel(f"ms per {x['payload_bytes'] / 2**20:.0f} MiB ({x['prompt_len']} tokens), median")
        ax_x.set_title(C.ratio_caption("transfer_vs_raw_gloo", ratios, TARGETS), fontsize=9)
        ax_x.legend(fontsize=6, loc="upper left")
        ax_x.margins(y=0.25)

    t = (raw.get("disaggregated") or {}).get("ttft")
    if t:
        m = t["median"]
        bottom = 0.0
        for part, color in (("queue_s", "#cccccc"), ("prefill_s", "#1f77b4"), ("transfer_s", "#d62728"),
                            ("router_rest_s", "#fdae6b"), ("driver_hop_s", "#9467bd")):
            h = max(m[part], 0.0) * 1e3
            ax_t.bar(["cluster\n(client TTFT)"], [h], bottom=bottom, color=color,
                     label=f"{part.removesuffix('_s')} {m[part] * 1e3:.1f} ms")
            bottom += h
        eng = (raw.get("transfer") or {}).get("engine_prefill_1thread_median_s")
        if eng and raw["transfer"]["prompt_len"] == t["prompt_len"]:
            ax_t.bar(["engine prefill\n(1 thread, no Ray)"], [eng * 1e3], color="tab:gray",
                     label=f"engine prefill {eng * 1e3:.0f} ms")
        ax_t.set_ylabel(f"ms, median of {t['reps']} ({t['prompt_len']}-token prompt)")
        ax_t.set_title(C.ratio_caption("transfer_share_of_ttft", ratios, TARGETS), fontsize=9)
        ax_t.legend(fontsize=6, loc="lower right")

    colors = {"disaggregated": "tab:blue", "colocated": "tab:orange"}
    for mode in ("disaggregated", "colocated"):
        itl = (raw.get(mode) or {}).get("itl")
        if not itl:
            continue
        for key, style, label in (("gaps_window_s", "-", "prefills arriving"), ("gaps_quiet_s", ":", "quiet")):
            xs = np.sort(np.asarray(itl[key])) * 1e3
            if len(xs):
                ax_cdf.plot(xs, np.arange(1, len(xs) + 1) / len(xs), style, color=colors[mode],
                            label=f"{mode} ({label})")
        p99 = itl["itl_window_s"].get("p99")
        if p99:
            ax_cdf.axvline(p99 * 1e3, color=colors[mode], lw=0.8, ls="--")
            ax_cdf.annotate(f"p99 {p99 * 1e3:.0f} ms", (p99 * 1e3, 0.5), color=colors[mode], fontsize=7,
                            rotation=90, ha="right")
        series = np.asarray(itl["gap_series"]) if itl["gap_series"] else np.zeros((0, 2))
        ax_ts.scatter(series[:, 0], series[:, 1] * 1e3, s=3, color=colors[mode], label=mode, alpha=0.6)
        for s in itl["long_submit_s"]:
            ax_ts.axvline(s, color=colors[mode], lw=0.6, ls=":")
    ax_cdf.set_xscale("log")
    ax_cdf.set_xlabel("inter-token gap, ms (driver-side)")
    ax_cdf.set_ylabel("CDF")
    ax_cdf.set_title(C.ratio_caption("itl_p99_disagg_vs_colocated", ratios, TARGETS), fontsize=9)
    ax_cdf.legend(fontsize=6, loc="lower right")
    ax_ts.set_yscale("log")
    ax_ts.set_xlabel("s since the first long prompt (dotted: submissions)")
    ax_ts.set_ylabel("inter-token gap, ms")
    ax_ts.set_title("decode gaps over time", fontsize=9)
    ax_ts.legend(fontsize=6, loc="upper right")
    return fig


# -- main ---------------------------------------------------------------------------------------
def print_transfer(xfer: dict) -> None:
    b = xfer["receiver_breakdown_median_s"]
    print(f"  {xfer['payload_bytes'] / 2**20:.1f} MiB: ours {xfer['ours_median_s'] * 1e3:.2f} ms "
          f"({xfer['ours_bytes_per_s'] / 1e9:.2f} GB/s), raw gloo {xfer['raw_median_s'] * 1e3:.2f} ms "
          f"({xfer['raw_bytes_per_s'] / 1e9:.2f} GB/s), raw into a fresh buffer "
          f"{xfer['raw_fresh_median_s'] * 1e3:.2f} ms")
    print(f"  receiver: header wait {b['header_wait_s'] * 1e3:.2f} ms (sender export "
          f"{xfer['sender_export_median_s'] * 1e3:.2f}), payload {b['payload_s'] * 1e3:.2f}, write_kv "
          f"{b['write_kv_s'] * 1e3:.2f}; checksum alone {xfer['receiver_checksum_alone_median_s'] * 1e3:.2f} ms")


def print_cluster(res: dict) -> None:
    if "ttft" in res:
        m = res["ttft"]["median"]
        print(f"  TTFT {m['client_ttft_s'] * 1e3:.0f} ms (client): queue {m['queue_s'] * 1e3:.1f}, prefill "
              f"{m['prefill_s'] * 1e3:.0f}, transfer {m['transfer_s'] * 1e3:.1f}, rest {m['router_rest_s'] * 1e3:.1f}, "
              f"driver hop {m['driver_hop_s'] * 1e3:.1f} ms; one bare engine {m['engine_ttft_s'] * 1e3:.0f} ms")
    s, w = res["itl"]["itl_window_s"], res["itl"]["cpu"]["window"]
    print(f"  ITL (prefills arriving) p50 {s['p50'] * 1e3:.1f} ms, p99 {s['p99'] * 1e3:.1f} ms over {s['n']} gaps; "
          f"quiet p50 {res['itl']['itl_quiet_s']['p50'] * 1e3:.1f} ms")
    top = ", ".join(f"{k.removeprefix('ours: ')} {v:.2f}" for k, v in w["cores_by_process"].items()
                    if k.startswith(("ours:", "this process")))
    print(f"  cores used in the window: ours {w['ours_cores']:.2f} ({top}); other people's processes "
          f"{w['other_cores']:.2f}, kernel threads {w['kernel_cores']:.2f}, stolen {w['steal_cores'] or 0:.2f}")
    if w["other_cores"] > 0.1:
        print("  WARNING: other people's processes competed for the cores in this window")


def itl_summary(disagg: dict | None, coloc: dict | None, ref: dict | None) -> dict:
    """Each mode's ITL in the window and when quiet, its long requests, and the quiet gap over a bare engine step."""
    out = {}
    for mode, res, threads in (("disaggregated", disagg, 1), ("colocated", coloc, CORES)):
        if not res:
            continue
        longs = res["itl"]["long_requests"]
        out[mode] = {"window": res["itl"]["itl_window_s"], "quiet": res["itl"]["itl_quiet_s"],
                     "long_request_ttft_s": [r.get("ttft_s") for r in longs],
                     "long_request_transfer_s": [r.get("transfer_s") for r in longs],
                     "cpu_window": res["itl"]["cpu"]["window"]}
        if ref:
            step = ref[f"step_{threads}thread_median_s"]
            out[mode].update(engine_step_median_s=step, quiet_p50_minus_engine_step_s=out[mode]["quiet"]["p50"] - step)
    return out


def phase_clusters(run: BenchRun, plan: Plan, model: str, seed: int) -> tuple[dict | None, ...]:
    """The bare-engine reference, then the disaggregated and the colocated cluster."""
    ref = run.phase("engine_reference", phase_engine_reference, plan, model, seed)
    if ref:
        print(f"  bare engine, batch-{ref['batch']} decode step: 1 thread {ref['step_1thread_median_s'] * 1e3:.1f} ms, "
              f"{CORES} threads {ref[f'step_{CORES}thread_median_s'] * 1e3:.1f} ms")
    results = []
    for mode, with_ttft in (("disaggregated", True), ("colocated", False)):
        res = run.phase(mode, phase_cluster, plan, model, mode, seed, run.show, with_ttft)
        if res:
            print_cluster(res)
        results.append(res)
    try:
        import ray

        ray.shutdown()
    except Exception:
        pass
    return ref, *results


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "smoke run (< 1 min): few reps, 512-token transfer/TTFT prompts, one 1,024-token "
                    "interfering prompt; writes disagg_bench.quick.json/png", model=C.REAL_MODEL, plot=True,
                    progress=True, seed=True)
    ap.add_argument("--interval", type=float, default=None,
                    help="seconds between the long prompts of the ITL phase (default: plan's, 3 s full)")
    ap.add_argument("--long-prompts", type=int, default=None,
                    help="how many long prompts the ITL phase submits (default: 4 full, 1 quick)")
    ap.add_argument("--skip", action="append", default=[], choices=["transfer", "cluster"],
                    help="skip a part (repeatable); its ratios are then n/a")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the driver only drives; the workers own the cores
    probe = C.CpuWatch()
    time.sleep(0.5)
    idle_probe = probe.stop()
    model_info = C.prepare_model(args.model)
    run = BenchRun(NAME, TARGETS, args, keep_going=True, by_process=True, cluster_cores=CORES)
    plan = run.plan(FULL, QUICK, itl_interval_s=args.interval, itl_long_prompts=args.long_prompts)
    print(f"{run.name}: model={args.model} float32, {CORES} cores for the workers, load average "
          f"{run.machine['load_average_start']}, other processes {idle_probe.get('other_cpu_share', 0):.0%} of the "
          "CPUs before start")
    xfer = None if "transfer" in args.skip else run.phase("transfer", phase_transfer, plan, args.model, args.seed,
                                                          run.show)
    if xfer:
        print_transfer(xfer)
    ref, disagg, coloc = (None, None, None) if "cluster" in args.skip else phase_clusters(run, plan, args.model,
                                                                                            args.seed)
    p99 = {mode: (((res or {}).get("itl") or {}).get("itl_window_s") or {}).get("p99")
           for mode, res in (("disaggregated", disagg), ("colocated", coloc))}
    ratios = {
        "transfer_vs_raw_gloo": xfer["raw_median_s"] / xfer["ours_median_s"] if xfer else None,
        "transfer_share_of_ttft": disagg["ttft"]["median"]["share"] if disagg else None,
        "disagg_ttft_vs_engine": disagg["ttft"]["vs_engine"] if disagg else None,
        "itl_p99_disagg_vs_colocated": (p99["disaggregated"] / p99["colocated"]
                                        if p99["disaggregated"] and p99["colocated"] else None),
    }
    return run.finish(ratios, plot, model=args.model, model_info=model_info, dtype="float32", seed=args.seed,
                      cores=CORES, max_num_batched_tokens=plan.max_num_batched_tokens, num_blocks=plan.num_blocks,
                      transfer=xfer, engine_reference=ref, itl_summary=itl_summary(disagg, coloc, ref),
                      disaggregated=disagg, colocated=coloc, idle_probe=idle_probe)


if __name__ == "__main__":
    sys.exit(main())
