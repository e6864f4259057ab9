"""spec_bench's raw.disagg_draft_kv: the draft's prompt KV shipped from the prefill worker
(speculative.draft_kv "ship") against the decode worker's draft computing it ("recompute").

The plain prefill and decode workers (no Ray) in this process over a real gloo pair, on the
random-weight presets `bench` (target) and `bench-draft` (same 32k vocabulary, ~1/8 of the
work), greedy, one request at a time, prefix caches off; both pairs live at once and take the
prompts in turn (in alternating order), so load on the machine hits both alike. Per request: the time to its first
token (the prefill; with ship the draft's prefill of the prompt too, before the first token
is answered), to its second (the KV transfer and the first decode step, where with recompute
the draft runs over the whole prompt) and to its last. ship_s and recompute_s sum the whole
requests' times. Then at load: all prompts submitted at once, twice per mode (ship, recompute,
recompute, ship): the decode worker then runs the others' steps while each new request
arrives, and with recompute each arrival's first step also runs the draft over its prompt;
concurrent_ship_s and concurrent_recompute_s sum the wall times. The speculative.draft_kv
default follows the faster (docs/ARCHITECTURE.md).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from decode_worker import DecodeWorker
from engine import CacheConfig, EngineConfig, Role, SamplingParams
from engine.config import SpeculativeConfig
from engine.messages import GenerateRequest
from kv_transfer import TransferConfig, new_ticket
from prefill_worker import PrefillWorker

TARGET, DRAFT = "bench", "bench-draft"
VOCAB = 32000  # bench's tokenizer (bpe-32k); ids below it are all real tokens


async def _one(prefill: PrefillWorker, decode: DecodeWorker, rid: str, prompt: list[int],
               params: SamplingParams) -> dict:
    req = GenerateRequest(rid, prompt, params)
    handle = decode.reserve(rid, len(prompt), prefill.worker_id)
    if handle is None:
        raise RuntimeError(f"the decode worker has no blocks for {rid}")
    t0 = time.perf_counter()
    first = await asyncio.wrap_future(prefill.prefill(req, handle))
    t1 = time.perf_counter()
    tokens, t2, timing = [first.first_token_id], None, None
    async for chunk in decode.stream(req, first, handle):
        t2 = t2 or time.perf_counter()
        timing = timing or chunk.timing
        tokens += chunk.token_ids
    t3 = time.perf_counter()
    return {"first_token_s": t1 - t0, "second_token_s": t2 - t1, "total_s": t3 - t0, "tokens": tokens,
            "transfer_bytes": timing.transfer_bytes, "recomputed": timing.recomputed}


async def _all(pair: tuple[PrefillWorker, DecodeWorker], prefix: str, prompts: list[list[int]],
               params: SamplingParams) -> list[dict]:
    return await asyncio.gather(*(_one(*pair, f"{prefix}-{i}", p, params) for i, p in enumerate(prompts)))


def _pair(mode: str, dtype: str, num_blocks: int) -> tuple[PrefillWorker, DecodeWorker]:
    spec = SpeculativeConfig(method="draft", draft_model=DRAFT, k=4, draft_kv=mode)
    cfg = EngineConfig(model=TARGET, dtype=dtype, speculative=spec,
                       cache=CacheConfig(num_blocks=num_blocks, enable_prefix_cache=False))
    transfer = TransferConfig(backend="gloo", timeout_s=60.0, connect_timeout_s=60.0)
    prefill = PrefillWorker(f"prefill-{mode}", cfg, transfer)
    decode = DecodeWorker(f"decode-{mode}", cfg.model_copy(update={"role": Role.DECODE}), transfer)
    with ThreadPoolExecutor(1) as pool:
        ticket = new_ticket()  # what the router hands both sides
        accepted = pool.submit(decode.accept, ticket)
        prefill.connect(decode.worker_id, decode.address, ticket)
        accepted.result(timeout=60)
    return prefill, decode


def measure(dtype: str, num_prompts: int, prompt_tokens: int, max_tokens: int, seed: int = 0) -> dict:
    """raw.disagg_draft_kv: {ship_s, recompute_s, faster, per-mode medians, tokens_equal}."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(prompt_tokens)] for _ in range(num_prompts + 1)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    modes = ("ship", "recompute")
    print(f"- disaggregated draft KV, {num_prompts} x {prompt_tokens} tokens: ship vs recompute ...", flush=True)
    # Room for every prompt at once (the concurrent rounds): a decode worker out of blocks
    # refuses the reservation, which this harness, having no router to wait in, cannot retry.
    block_size = CacheConfig().block_size
    num_blocks = num_prompts * -(-(prompt_tokens + max_tokens + 8) // block_size) + 16
    pairs = {mode: _pair(mode, dtype, num_blocks) for mode in modes}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    concurrent = {mode: 0.0 for mode in modes}
    try:
        for i, prompt in enumerate(prompts):
            for mode in modes if i % 2 else modes[::-1]:
                run = asyncio.run(_one(*pairs[mode], f"{mode}-{i}", prompt, params))
                if i:  # the first prompt warms both pairs up
                    runs[mode].append(run)
        for round_, mode in enumerate(modes + modes[::-1]):
            t0 = time.perf_counter()
            asyncio.run(_all(pairs[mode], f"{mode}-c{round_}", prompts[1:], params))
            concurrent[mode] += time.perf_counter() - t0
    finally:
        for worker in (w for pair in pairs.values() for w in pair):
            worker.close()
    out: dict = {"target": TARGET, "draft": DRAFT, "prompts": num_prompts, "prompt_tokens": prompt_tokens,
                 "max_tokens": max_tokens, "tokens_equal": [r.pop("tokens") for r in runs["ship"]] ==
                 [r.pop("tokens") for r in runs["recompute"]]}
    for mode in modes:
        out[f"{mode}_s"] = sum(r["total_s"] for r in runs[mode])
        out[mode] = {key: statistics.median(r[key] for r in runs[mode])
                     for key in ("first_token_s", "second_token_s", "total_s", "transfer_bytes")}
        out[mode]["recomputed"] = sum(r["recomputed"] for r in runs[mode])
        print(f"  {mode}: {out[f'{mode}_s']:.2f} s; median first token {out[mode]['first_token_s'] * 1e3:.0f} ms, "
              f"second {out[mode]['second_token_s'] * 1e3:.0f} ms", flush=True)
        out[f"concurrent_{mode}_s"] = concurrent[mode]
    print(f"  at load: ship {concurrent['ship']:.2f} s, recompute {concurrent['recompute']:.2f} s", flush=True)
    out["faster"] = "ship" if out["ship_s"] < out["recompute_s"] else "recompute"
    out["faster_at_load"] = "ship" if concurrent["ship"] < concurrent["recompute"] else "recompute"
    return out
