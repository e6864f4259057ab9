"""Engine benchmark: three ratios that say how close Brigade's engine is to what this machine allows.

All three are measured in ONE run on SmolLM2-135M-Instruct (`smollm2-135m`: Llama, 30 layers,
hidden 576, 9/3 heads, vocab 49,152, tied embeddings; real weights from the registry, pulled and
converted on first use) in float32, with torch using every core. `--model bench` (Qwen3: hidden
512, 8 layers, 8/2 heads, vocab 32k; random weights, no download) or `--model tiny` runs a preset.
Each is a ratio against a baseline measured in the same run, so it compares across machines:

  decode_step_vs_floor     (target <= 2.0)
      Median batch-1 decode step (engine.step(), one request, ~128-token prompt, prefill step
      excluded) divided by the memory-bandwidth floor
          floor = (weight bytes read per step + KV bytes read at the measured context) / bandwidth
      Weight bytes: every parameter once; the embedding table counts one row (the lookup) unless
      it is the LM head's own storage (tied and shared), then it counts once, in full.
      Bandwidth: a 256 MiB float32 dst.copy_(src), best of several, counting read + write bytes
      (STREAM "copy"). Raw also holds the read-only bandwidth (src.sum()) and the floor under it,
      a per-phase breakdown of the step (scheduler, input prep, model, LM head, sampler), and the
      time of the model's Linear layers alone on one token (torch's own GEMV speed: what the step
      could reach with zero overhead around the matmuls).

  throughput_vs_hf         (target >= 2.0)
      Output tokens/s of 64 requests (prompt lengths uniform in [64, 512], output lengths uniform in
      [16, 256], greedy, ignore_eos, seeded random token ids) all submitted at once to
      engine.generate(), divided by the better of transformers' model.generate() on the same
      weights and requests in static batches of 16 and of 64 (left padding + attention_mask,
      max_new_tokens = the batch's longest output, EOS suppressed). Only each request's own
      output length counts as useful HF output; the padding work is HF's cost.

  prefix_hit_ttft_vs_cold  (target <= 0.2)
      Time to first token of a 1,024-token prompt whose first 960 tokens are in the prefix cache
      (warmed by a prompt sharing them) divided by the same-length prompt with nothing cached.
      TTFT = add_request() -> the step() that returns its token. The scheduler budget is >= the
      prompt length, so the cold prompt prefills in one step. Median of several reps.

Output: benchmarks/results/engine_bench.json ({"machine", "ratios", "targets", "raw"}) and
engine_bench.png (ours vs HF throughput, decode step vs floor, TTFT cold vs hit). With --quick
(a smoke run, < 1 minute on a quiet machine: fewer and shorter requests, a 512-token TTFT
prompt, HF batch 8 only) the files are engine_bench.quick.json/.png, so a smoke run never
overwrites the committed full results.
A missed target prints MISS and still exits 0. Numbers are only meaningful on a quiet machine
(torch's threads wait for each other, so one competing process can slow a phase several-fold):
raw.phase_cpu records, per phase, the share of the CPUs other processes used (other_cpu_share;
a warning is printed above 5%) and the load average; rerun any phase that shows one.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from benchmarks import _common as C
from benchmarks.harness.run import BenchRun, bench_args
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

NAME = "engine_bench"
TARGETS = {
    "decode_step_vs_floor": "<= 2.0",
    "throughput_vs_hf": ">= 2.0",
    "prefix_hit_ttft_vs_cold": "<= 0.2",
}
BLOCK_SIZE = 16
FIRST_ID = 3  # ids 0..2 are <|endoftext|>, <|im_start|>, <|im_end|>: keep prompts to ordinary tokens


@dataclass(frozen=True)
class Plan:
    bw_mib: int = 256
    bw_reps: int = 7
    decode_prompt_len: int = 128
    decode_warmup_steps: int = 8
    decode_steps: int = 128
    decode_breakdown_steps: int = 32
    tp_requests: int = 64
    tp_prompt_len: tuple[int, int] = (64, 512)
    tp_output_len: tuple[int, int] = (16, 256)
    hf_batch_sizes: tuple[int, ...] = (16, 64)
    ttft_prompt_len: int = 1024
    ttft_cached_len: int = 960
    ttft_reps: int = 7
    ttft_max_batched_tokens: int = 2048


FULL = Plan()
# A smoke run sized for SmolLM2 (a decode step reads ~3.4x the bench preset's weight bytes).
QUICK = Plan(bw_reps=3, decode_warmup_steps=2, decode_steps=32, decode_breakdown_steps=8,
             tp_requests=8, tp_prompt_len=(32, 128), tp_output_len=(8, 32), hf_batch_sizes=(8,),
             ttft_prompt_len=512, ttft_cached_len=480, ttft_reps=2)


# -- helpers ---------------------------------------------------------------------------------
def make_engine(model: str, num_blocks: int, max_num_seqs: int = 128,
                max_num_batched_tokens: int = 2048) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=model, dtype="float32",
        cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens),
    ))


def engine_settings(engine: LLMEngine) -> dict:
    c = engine.config
    return {"num_blocks": c.cache.num_blocks, "block_size": c.cache.block_size,
            "enable_prefix_cache": c.cache.enable_prefix_cache, "max_num_seqs": c.scheduler.max_num_seqs,
            "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
            "enable_chunked_prefill": c.scheduler.enable_chunked_prefill}


def blocks_for(tokens: int) -> int:
    return -(-tokens // BLOCK_SIZE)


def random_ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, size=n).tolist()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def weight_bytes_per_step(model: torch.nn.Module) -> dict:
    """Bytes of weights one decode step must read (a dense model reads every matrix once).

    Tensors sharing storage count once. The embedding table is only looked up (one row per
    token), so it counts as one row, unless it is also the LM head's storage (tied and shared),
    in which case it is read in full once, as the LM head. A tied checkpoint whose LM head the
    engine keeps as a separate (e.g. transposed) copy reads that copy in full plus one row.
    """
    embed = model.embed_tokens.weight
    head_ptrs = {p.data_ptr() for p in model.lm_head.parameters()}
    shared = embed.data_ptr() in head_ptrs
    unique = {id(p): p for p in C.unique_weights(model)}
    total = sum(p.numel() * p.element_size() for p in unique.values())
    embed_bytes = embed.numel() * embed.element_size()
    row = embed.shape[1] * embed.element_size()
    if not shared:
        total += row - embed_bytes
    return {"weight_bytes": total, "embedding_shared_with_lm_head": shared, "embedding_bytes": embed_bytes,
            "resident_param_bytes": sum(p.numel() * p.element_size() for p in unique.values()),
            "num_unique_params": sum(p.numel() for p in unique.values())}


# -- 0. bandwidth ---------------------------------------------------------------------------
def phase_bandwidth(plan: Plan) -> dict:
    return C.measure_copy_bandwidth(plan.bw_mib, plan.bw_reps)


# -- 1. batch-1 decode vs the bandwidth floor ---------------------------------------------------
class _Timed:
    """Wraps a callable and accumulates its wall time under `name` in `sink`."""

    def __init__(self, fn, name: str, sink: dict):
        self.fn, self.name, self.sink = fn, name, sink

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.sink[self.name] = self.sink.get(self.name, 0.0) + time.perf_counter() - t0


def _instrument(engine: LLMEngine, sink: dict) -> None:
    """Time the phases of LLMEngine.step() by wrapping its collaborators on this instance only."""
    engine.scheduler.schedule = _Timed(engine.scheduler.schedule, "schedule", sink)
    engine.runner._prepare = _Timed(engine.runner._prepare, "prepare_inputs", sink)
    engine.runner.model.forward = _Timed(engine.runner.model.forward, "model_forward", sink)
    engine.runner.model.compute_logits = _Timed(engine.runner.model.compute_logits, "lm_head", sink)
    engine.scheduler.after_step = _Timed(engine.scheduler.after_step, "after_step", sink)
    engine.sampler = _Timed(engine.sampler, "sample", sink)


def _linear_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """(module, in_features) for every matmul layer: nn.Linear or a Linear-like module whose own
    2-D parameter is `weight` (out, in) or `weight_t` (in, out), or whose weight oneDNN holds
    packed (out, in). Shared modules appear once."""
    found, seen = [], set()
    for m in model.modules():
        if isinstance(m, torch.nn.Embedding):
            continue
        own = dict(m.named_parameters(recurse=False))
        w, wt, packed = own.get("weight"), own.get("weight_t"), getattr(m, "packed", None)
        if packed is not None:
            ptr, fan_in = id(packed), packed.shape[1]
        elif wt is not None and wt.dim() == 2:
            ptr, fan_in = wt.data_ptr(), wt.shape[0]
        elif w is not None and w.dim() == 2:
            ptr, fan_in = w.data_ptr(), w.shape[1]
        else:
            continue
        if ptr not in seen:
            seen.add(ptr)
            found.append((m, fan_in))
    return found


@torch.inference_mode()
def gemv_only_seconds(model: torch.nn.Module, reps: int = 30) -> dict:
    """Median time of the model's own Linear modules applied to one token, back to back: what
    the step would cost with zero overhead around the matmuls (attention and norms excluded)."""
    layers = _linear_modules(model)
    dtype = next(model.parameters()).dtype
    xs = {n: torch.randn(1, n, dtype=dtype) for _, n in layers}
    for m, n in layers:
        m(xs[n])
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for m, n in layers:
            m(xs[n])
        times.append(time.perf_counter() - t0)
    nbytes = sum(p.numel() * p.element_size() for m, _ in layers for p in m.parameters(recurse=False))
    med = statistics.median(times)
    return {"seconds_median": med, "seconds_min": min(times), "bytes": nbytes, "bytes_per_s": nbytes / med,
            "num_matrices": len(layers)}


def phase_decode(plan: Plan, model: str, seed: int, show: bool, profile: bool) -> dict:
    total_out = (plan.decode_warmup_steps + plan.decode_steps + plan.decode_breakdown_steps
                 + (8 if profile else 0) + 2)
    engine = make_engine(model, num_blocks=blocks_for(plan.decode_prompt_len + total_out) + 4, max_num_seqs=8)
    mc = engine.model_config
    rng = np.random.default_rng(seed)
    prompt = random_ids(rng, plan.decode_prompt_len, mc.vocab_size)
    engine.add_request("decode", prompt, greedy(total_out))

    t0 = time.perf_counter()
    outs = engine.step()
    prefill_s = time.perf_counter() - t0
    assert len(outs) == 1 and len(outs[0].new_token_ids) == 1, "the prefill step should sample one token"

    def one_step() -> int:
        (out,) = engine.step()
        assert len(out.new_token_ids) == 1
        return plan.decode_prompt_len + len(out.token_ids) - 1  # tokens whose KV this step attended to

    for _ in range(plan.decode_warmup_steps):
        one_step()
    times, contexts = [], []
    with C.progress("decode steps (batch 1)", plan.decode_steps, show) as advance:
        for _ in range(plan.decode_steps):
            t0 = time.perf_counter()
            ctx = one_step()
            times.append(time.perf_counter() - t0)
            contexts.append(ctx)
            advance()

    profile_table = None
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(8):
                one_step()
        profile_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)

    # Per-phase breakdown on further steps of the same request (instrumented, so timed apart).
    sink: dict[str, float] = {}
    _instrument(engine, sink)
    t_all = 0.0
    for _ in range(plan.decode_breakdown_steps):
        t0 = time.perf_counter()
        one_step()
        t_all += time.perf_counter() - t0
    n = plan.decode_breakdown_steps
    breakdown = {k: v / n for k, v in sink.items()}
    # model_forward includes nothing else; prepare_inputs + forward + lm_head = ModelRunner.run.
    breakdown["other_python"] = t_all / n - sum(breakdown.values())
    breakdown["step_total"] = t_all / n
    engine.abort("decode")

    weights = weight_bytes_per_step(engine.runner.model)
    gemv = gemv_only_seconds(engine.runner.model)
    return {
        "settings": engine_settings(engine), "prompt_len": plan.decode_prompt_len,
        "warmup_steps": plan.decode_warmup_steps, "prefill_step_s": prefill_s,
        "step_seconds": times, "step_stats_s": C.summarize(times),
        "context_len_median": statistics.median(contexts),
        "context_len_range": [min(contexts), max(contexts)],
        "kv_bytes_per_token": mc.kv_bytes_per_token(engine.dtype),
        "breakdown_steps": n, "breakdown_s": breakdown,
        "gemv_only": gemv, "profile_table": profile_table, **weights,
        "model": {"architecture": mc.architecture, "hidden_size": mc.hidden_size, "num_layers": mc.num_layers,
                  "num_heads": mc.num_heads, "num_kv_heads": mc.num_kv_heads, "head_dim": mc.head_dim,
                  "intermediate_size": mc.intermediate_size, "vocab_size": mc.vocab_size},
    }


# -- 3. prefix-cache hit TTFT vs cold ---------------------------------------------------------
def phase_ttft(plan: Plan, model: str, seed: int, show: bool) -> dict:
    L, P = plan.ttft_prompt_len, plan.ttft_cached_len
    budget = max(plan.ttft_max_batched_tokens, L)
    # Enough blocks that nothing from this phase is evicted: a warm-up + 3 prompts per rep.
    engine = make_engine(model, num_blocks=(3 * plan.ttft_reps + 2) * blocks_for(L + 1) + 8,
                         max_num_seqs=8, max_num_batched_tokens=budget)
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(seed + 3)

    def ttft(rid: str, prompt: list[int]) -> tuple[float, int, int]:
        t0 = time.perf_counter()
        engine.add_request(rid, prompt, greedy(1))
        steps = 0
        while True:
            steps += 1
            for out in engine.step():
                if out.request_id == rid and out.new_token_ids:
                    return time.perf_counter() - t0, out.usage.cached_tokens, steps

    ttft("warmup", random_ids(rng, L, vocab))
    cold, warm, hit, cached, cold_cached, steps_cold, steps_hit = [], [], [], [], [], [], []
    with C.progress(f"TTFT {L}-token prompt, cold / warm / hit", plan.ttft_reps, show) as advance:
        for r in range(plan.ttft_reps):
            s, c, n = ttft(f"cold-{r}", random_ids(rng, L, vocab))  # fresh random prompt: nothing cached
            cold.append(s), cold_cached.append(c), steps_cold.append(n)
            prefix = random_ids(rng, P, vocab)
            s, _, _ = ttft(f"warm-{r}", prefix + random_ids(rng, L - P, vocab))
            warm.append(s)
            s, c, n = ttft(f"hit-{r}", prefix + random_ids(rng, L - P, vocab))
            hit.append(s), cached.append(c), steps_hit.append(n)
            advance()
    return {
        "settings": engine_settings(engine), "prompt_len": L, "shared_prefix_len": P, "reps": plan.ttft_reps,
        "cold_s": cold, "warm_s": warm, "hit_s": hit,
        "cold_stats_s": C.summarize(cold), "hit_stats_s": C.summarize(hit),
        "hit_cached_tokens": cached, "cold_cached_tokens": cold_cached,
        "cold_steps_to_first_token": steps_cold, "hit_steps_to_first_token": steps_hit,
        "cold_prefilled_in_one_step": all(n == 1 for n in steps_cold),
    }


# -- 2. throughput vs transformers ------------------------------------------------------------
def make_workload(plan: Plan, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed + 2)
    n = plan.tp_requests
    plens = rng.integers(plan.tp_prompt_len[0], plan.tp_prompt_len[1] + 1, size=n).tolist()
    olens = rng.integers(plan.tp_output_len[0], plan.tp_output_len[1] + 1, size=n).tolist()
    return [random_ids(rng, p, vocab) for p in plens], olens


def length_stats(xs: list[int]) -> dict:
    return {"n": len(xs), "sum": int(sum(xs)), "mean": statistics.fmean(xs), "median": statistics.median(xs),
            "min": min(xs), "max": max(xs)}


def phase_throughput_ours(plan: Plan, model: str, prompts, olens, show: bool) -> dict:
    need = sum(blocks_for(len(p) + o) for p, o in zip(prompts, olens))
    engine = make_engine(model, num_blocks=need + 64)  # the whole workload fits: no preemption
    vocab = engine.model_config.vocab_size
    warm_rng = np.random.default_rng(12345)
    engine.generate([random_ids(warm_rng, 48, vocab) for _ in range(2)], greedy(4))
    params = [greedy(o) for o in olens]
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, progress=show)
    elapsed = time.perf_counter() - t0
    lens = [len(o.token_ids) for o in outs]
    assert lens == list(olens), "every request should produce exactly its output length (ignore_eos)"
    stats = engine.stats()
    return {"settings": engine_settings(engine), "seconds": elapsed, "output_tokens": sum(lens),
            "tokens_per_s": sum(lens) / elapsed, "preemptions": stats["preemptions"],
            "token_ids": [o.token_ids for o in outs]}


def phase_throughput_hf(plan: Plan, model: str, prompts, olens, ours_tokens, show: bool) -> dict:
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.presets import resolve_model

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(resolve_model(model), dtype=torch.float32).eval()
    load_s = time.perf_counter() - t0
    pad = hf.generation_config.pad_token_id
    pad = 0 if pad is None else pad

    def run_batch(idx: list[int]) -> tuple[float, torch.Tensor, int]:
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):
            p = prompts[i]
            ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        m = max(olens[i] for i in idx)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=m, min_new_tokens=m,
                              do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - t0
        gen = out[:, width:]
        assert gen.shape[1] == m, f"HF stopped early: {gen.shape[1]} of {m} tokens"
        return elapsed, gen, width

    warm = list(range(min(2, len(prompts))))
    hf.generate(input_ids=torch.full((len(warm), 16), FIRST_ID), attention_mask=torch.ones(len(warm), 16,
                dtype=torch.long), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=pad)

    results = {}
    n = len(prompts)
    for bs in plan.hf_batch_sizes:
        batches = [list(range(s, min(s + bs, n))) for s in range(0, n, bs)]
        per_batch, total_s, match = [], 0.0, []
        with C.progress(f"transformers generate, batch {bs}", len(batches), show) as advance:
            for idx in batches:
                s, gen, width = run_batch(idx)
                total_s += s
                for row, i in enumerate(idx):
                    ours = ours_tokens[i]
                    theirs = gen[row, : olens[i]].tolist()
                    k = next((j for j, (a, b) in enumerate(zip(ours, theirs)) if a != b), len(ours))
                    match.append(k / len(ours))
                per_batch.append({"size": len(idx), "seconds": s, "padded_prompt_len": width,
                                  "max_new_tokens": gen.shape[1], "useful_tokens": sum(olens[i] for i in idx),
                                  "generated_tokens": len(idx) * gen.shape[1]})
                advance()
        useful = sum(b["useful_tokens"] for b in per_batch)
        results[str(bs)] = {"seconds": total_s, "useful_tokens": useful,
                            "generated_tokens": sum(b["generated_tokens"] for b in per_batch),
                            "tokens_per_s": useful / total_s, "batches": per_batch,
                            "greedy_prefix_agreement_with_ours": statistics.fmean(match)}
    best = max(results, key=lambda k: results[k]["tokens_per_s"])
    return {"transformers": transformers.__version__, "load_s": load_s, "batch_sizes": results,
            "best_batch_size": int(best), "best_tokens_per_s": results[best]["tokens_per_s"],
            "attn_implementation": getattr(hf.config, "_attn_implementation", None),
            "padding": "left", "eos": "suppressed (min_new_tokens = max_new_tokens)"}


# -- plot ---------------------------------------------------------------------------------------
def plot(ratios: dict, raw: dict):
    title = (f"Brigade engine bench ({raw['model']}, float32, {raw['torch_threads']} threads"
             f"{', QUICK' if raw['quick'] else ''})")
    fig, (ax_tp, ax_dec, ax_ttft) = C.new_figure(3, title)
    tp = raw["throughput"]
    labels, values, colors = ["ours"], [tp["ours"]["tokens_per_s"]], ["tab:blue"]
    for bs, r in (tp.get("hf") or {}).get("batch_sizes", {}).items():
        labels.append(f"HF b{bs}")
        values.append(r["tokens_per_s"])
        colors.append("tab:gray")
    C.bar_panel(ax_tp, labels, values, C.ratio_caption("throughput_vs_hf", ratios, TARGETS), "output tok/s",
                colors)

    d = raw["decode"]
    bd = d["breakdown_s"]
    labels = ["floor\n(copy bw)", "floor\n(read bw)", "matmuls\nonly", "ours\nstep"]
    values = [d["floor_s"] * 1e3, d["floor_read_bw_s"] * 1e3, d["gemv_only"]["seconds_median"] * 1e3,
              d["step_stats_s"]["median"] * 1e3]
    C.bar_panel(ax_dec, labels, values, C.ratio_caption("decode_step_vs_floor", ratios, TARGETS),
                "ms per batch-1 step", ["tab:green", "tab:olive", "tab:gray", "tab:blue"], fmt="{:.1f}")
    # A stacked bar of where the (instrumented) step goes.
    bottom = 0.0
    parts = ["model_forward", "lm_head", "prepare_inputs", "schedule", "after_step", "sample", "other_python"]
    palette = ["#1f77b4", "#6baed6", "#fdae6b", "#fd8d3c", "#e6550d", "#a63603", "#cccccc"]
    for part, color in zip(parts, palette):
        h = max(bd.get(part, 0.0), 0.0) * 1e3
        ax_dec.bar(["ours\nby phase"], [h], bottom=bottom, color=color, label=part)
        bottom += h
    ax_dec.legend(fontsize=6, loc="upper left")

    t = raw["ttft"]
    C.bar_panel(ax_ttft, [f"cold\n({t['prompt_len']} new)", f"hit\n({t['shared_prefix_len']} cached)"],
                [t["cold_stats_s"]["median"] * 1e3, t["hit_stats_s"]["median"] * 1e3],
                C.ratio_caption("prefix_hit_ttft_vs_cold", ratios, TARGETS), "TTFT ms (median)",
                ["tab:gray", "tab:blue"], fmt="{:.0f}")
    return fig


# -- main ---------------------------------------------------------------------------------------
def measure_decode(plan: Plan, model: str, seed: int, show: bool, profile: bool, bw: dict) -> dict:
    """phase_decode, with the floor under the measured bandwidth."""
    dec = phase_decode(plan, model, seed, show, profile)
    if dec["profile_table"]:
        print(dec["profile_table"])
    kv_bytes = dec["kv_bytes_per_token"] * dec["context_len_median"]
    step_bytes = dec["weight_bytes"] + kv_bytes
    dec.update(kv_bytes_per_step=kv_bytes, bytes_per_step=step_bytes,
               floor_s=step_bytes / bw["copy_bytes_per_s"], floor_read_bw_s=step_bytes / bw["read_bytes_per_s"])
    step = dec["step_stats_s"]["median"]
    dec["ratio_under_read_bw"] = step / dec["floor_read_bw_s"]
    print(f"  step {step * 1e3:.2f} ms (median of {len(dec['step_seconds'])}), floor {dec['floor_s'] * 1e3:.2f} ms "
          f"({step_bytes / 1e6:.1f} MB), matmuls alone {dec['gemv_only']['seconds_median'] * 1e3:.2f} ms")
    return dec


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "smoke run (< 1 min): 8 short requests, HF batch 8, fewer reps; writes "
                    "engine_bench.quick.json/png", model=C.REAL_MODEL, plot=True, progress=True, seed=True,
                    threads=True)
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (throughput_vs_hf is then n/a)")
    ap.add_argument("--profile", action="store_true",
                    help="also print a torch.profiler table of 8 decode steps (top ops by self CPU time)")
    args = ap.parse_args(argv)
    C.set_all_threads(args.threads)
    model_info = C.prepare_model(args.model)
    run = BenchRun(NAME, TARGETS, args)
    plan = run.plan(FULL, QUICK)
    print(f"{NAME}{' --quick' if args.quick else ''}: model={args.model} float32, "
          f"{torch.get_num_threads()} torch threads, load average {run.machine['load_average_start']}")
    bw = run.phase("bandwidth", phase_bandwidth, plan)
    print(f"  copy {bw['copy_bytes_per_s'] / 1e9:.1f} GB/s (read+write), read {bw['read_bytes_per_s'] / 1e9:.1f} GB/s")
    dec = run.phase("decode", measure_decode, plan, args.model, args.seed, run.show, args.profile, bw)
    ttft = run.phase("ttft", phase_ttft, plan, args.model, args.seed, run.show)
    print(f"  cold {ttft['cold_stats_s']['median'] * 1e3:.0f} ms, hit {ttft['hit_stats_s']['median'] * 1e3:.0f} ms "
          f"(cached tokens {sorted(set(ttft['hit_cached_tokens']))})")
    prompts, olens = make_workload(plan, dec["model"]["vocab_size"], args.seed)
    ours = run.phase("throughput_ours", phase_throughput_ours, plan, args.model, prompts, olens, run.show)
    print(f"  ours {ours['tokens_per_s']:.1f} tok/s ({ours['output_tokens']} tokens in {ours['seconds']:.1f} s)")
    hf = None if args.no_hf else run.phase("throughput_hf", phase_throughput_hf, plan, args.model, prompts, olens,
                                           ours.pop("token_ids"), run.show)
    for bs, r in (hf or {}).get("batch_sizes", {}).items():
        print(f"  HF batch {bs}: {r['tokens_per_s']:.1f} useful tok/s ({r['seconds']:.1f} s)")
    ours.pop("token_ids", None)
    ratios = {
        "decode_step_vs_floor": dec["step_stats_s"]["median"] / dec["floor_s"],
        "throughput_vs_hf": ours["tokens_per_s"] / hf["best_tokens_per_s"] if hf else None,
        "prefix_hit_ttft_vs_cold": ttft["hit_stats_s"]["median"] / ttft["cold_stats_s"]["median"],
    }
    return run.finish(ratios, plot, model=args.model, model_info=model_info, dtype="float32", seed=args.seed,
                      torch_threads=torch.get_num_threads(), torch=torch.__version__, bandwidth=bw, decode=dec,
                      ttft=ttft, throughput={
                          "requests": len(prompts), "prompt_len": length_stats([len(p) for p in prompts]),
                          "output_len": length_stats(olens), "prompt_lens": [len(p) for p in prompts],
                          "output_lens": olens, "ours": ours, "hf": hf})


if __name__ == "__main__":
    sys.exit(main())
