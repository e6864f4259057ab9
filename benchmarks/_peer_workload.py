"""One system's side of peer_bench (not a benchmark itself): run in a fresh process, by our
venv's python for Brigade and transformers and by vLLM's own venv's python for vLLM.

    python -m benchmarks._peer_workload SPEC.json   (from the repository root)  ->  one stdout line "PEER_RESULT {json}"

SPEC: {"system": "brigade"|"transformers"|"vllm", "model": DIR, "dtype": "float32"|"bfloat16"|"auto",
       "quantization": "none"|"int8"|"gguf", "threads": 2, "bs1": {"ttft_prompts": [[ids]...],
       "decode_prompts": [[ids]...], "output_len": 128}, "batch": {"prompts": [[ids]...],
       "output_len": 128}, "perplexity": {"text": PATH, "window": 512, "max_windows": N} | null}

Every system is timed the same way, through its own offline generate call, greedy with EOS
ignored: TTFT = the median time of a 1-token generation of a fresh prompt; the bs1 decode
step = (median time of an output_len generation - TTFT) / (output_len - 1); batch throughput
= output tokens / wall time of one call with all prompts. Prompts are never repeated, so no
system gets a prefix-cache hit.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

MARK = "PEER_RESULT "  # vLLM writes its own lines to stdout too


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(generate, spec: dict) -> dict:
    """generate(list of id lists, n) runs n greedy tokens for each prompt in one call."""
    bs1, batch = spec["bs1"], spec["batch"]
    n = bs1["output_len"]
    generate([bs1["ttft_prompts"][0][:16]], 4)  # warm-up (allocators, lazy init)
    ttft = [_timed(lambda p=p: generate([p], 1)) for p in bs1["ttft_prompts"][1:]]
    full = [_timed(lambda p=p: generate([p], n)) for p in bs1["decode_prompts"]]
    t_first = statistics.median(ttft)
    decode = (statistics.median(full) - t_first) / (n - 1)
    wall = _timed(lambda: generate(batch["prompts"], batch["output_len"]))
    out_tokens = len(batch["prompts"]) * batch["output_len"]
    return {"ttft_s": t_first, "ttft_samples_s": ttft, "bs1_total_samples_s": full,
            "decode_step_s": decode, "batch_wall_s": wall, "batch_out_tok_per_s": out_tokens / wall}


# -- Brigade -----------------------------------------------------------------------------------
def run_brigade(spec: dict) -> dict:
    import torch

    from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig

    torch.set_num_threads(spec["threads"])
    n_seqs = max(16, len(spec["batch"]["prompts"]))
    engine = LLMEngine(EngineConfig(
        model=spec["model"], dtype=spec["dtype"], quantization=spec["quantization"], device="cpu",
        cache=CacheConfig(num_blocks=2048, block_size=16, enable_prefix_cache=False),
        scheduler=SchedulerConfig(max_num_seqs=n_seqs, max_num_batched_tokens=2048),
    ))

    def generate(prompts, n):
        engine.generate(prompts, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

    if spec.get("profile_steps"):
        return {"profile": profile_decode(engine, spec), "dtype_used": str(engine.dtype).removeprefix("torch.")}
    out = measure(generate, spec)
    out["dtype_used"] = str(engine.dtype).removeprefix("torch.")
    out["weight_bytes_per_step"] = weight_bytes_per_step(engine.runner.model)
    cfg = engine.model_config
    ctx = len(spec["bs1"]["decode_prompts"][0]) + spec["bs1"]["output_len"] // 2
    out["kv_bytes_per_step"] = cfg.kv_bytes_per_token(engine.dtype) * ctx
    if spec.get("perplexity"):
        out["perplexity"] = brigade_perplexity(engine, spec["perplexity"])
    return out


# op -> class, for the per-op-class profile of a decode step
_OP_CLASS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise", "aten::_weight_int8pack_mm",
               "aten::_weight_int4pack_mm_for_cpu"),
    "attention": ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::index_select", "aten::index_copy_"),
    "norm": ("aten::_fused_rms_norm",),
    "elementwise": ("aten::mul", "aten::add", "aten::add_", "aten::silu", "aten::cat", "aten::neg", "aten::copy_",
                    "aten::_to_copy", "aten::where", "aten::index", "aten::embedding", "aten::contiguous"),
    "sampling": ("aten::argmax", "aten::max", "aten::sort", "aten::topk", "aten::softmax", "aten::_softmax"),
}


def _by_class(prof, steps: int, wall: float) -> dict:
    by_class: dict[str, float] = {}
    others: dict[str, float] = {}
    for ev in prof.key_averages():
        cls = next((c for c, ops in _OP_CLASS.items() if ev.key in ops), "other ops")
        t = ev.self_cpu_time_total / 1e6 / steps
        by_class[cls] = by_class.get(cls, 0.0) + t
        if cls == "other ops":
            others[ev.key] = t
    top_other = dict(sorted(others.items(), key=lambda kv: -kv[1])[:8])
    return {"step_wall_s": wall, "by_class_s": by_class, "ops_total_s": sum(by_class.values()),
            "top_other_ops_s": top_other}


def _profiled(engine, steps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        wall = (time.perf_counter() - t0) / steps
    return _by_class(prof, steps, wall)


def profile_decode(engine, spec: dict) -> dict:
    """Where Brigade's time goes, by op class (torch.profiler self CPU time of the main thread,
    per step), for the three workloads: the bs1 decode step, the 512-token prefill (TTFT), and
    a decode step of the 16-prompt batch. Against each step's wall time, the rest is Python and
    framework overhead around the ops (scheduler, input prep, detokenizer, dispatch)."""
    from engine import SamplingParams

    steps = spec["profile_steps"]
    prompt = spec["bs1"]["decode_prompts"][0]
    greedy = SamplingParams(max_tokens=steps + 9, temperature=0.0, ignore_eos=True)
    engine.add_request("profile", prompt, greedy)
    engine.step()  # the prefill, unprofiled: allocators warm
    for _ in range(8):
        engine.step()
    out = {"decode_bs1": _profiled(engine, steps)}
    while engine.has_unfinished():
        engine.step()
    engine.add_request("profile-prefill", prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    out["prefill_bs1"] = _profiled(engine, 1)
    while engine.has_unfinished():
        engine.step()
    for i, p in enumerate(spec["batch"]["prompts"]):
        engine.add_request(f"profile-batch-{i}", p, greedy)
    for _ in range(len(spec["batch"]["prompts"]) + 4):  # every prompt prefilled, decode running
        engine.step()
    out["decode_batch"] = _profiled(engine, steps)
    while engine.has_unfinished():
        engine.step()
    out["note"] = "profiler on: steps are slower than unprofiled; shares, not absolute times, count"
    return out


def weight_bytes_per_step(model) -> int:
    """Weight bytes one decode step reads: every matrix once (quantized ones as stored), the
    embedding table one row (the LM head is its own copy in this engine)."""
    from benchmarks._common import unique_weights

    total = sum(t.numel() * t.element_size() for t in unique_weights(model))
    e = model.embed_tokens.weight
    return total - e.numel() * e.element_size() + e.shape[1] * e.element_size()


def brigade_perplexity(engine, spec: dict) -> dict:
    """exp(mean NLL) over non-overlapping windows of the text, each scored from its own start."""
    import torch

    from engine.sampling import SamplingParams
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    ids = engine.tokenizer.encode(Path(spec["text"]).read_text(encoding="utf-8"))
    w = spec["window"]
    windows = [ids[i : i + w] for i in range(0, len(ids) - w + 1, w)][: spec["max_windows"]]
    nll, count = 0.0, 0
    runner = engine.runner
    for win in windows:
        seq = Sequence("ppl", list(win), SamplingParams(), arrival=0)
        seq.block_table = engine.pool.allocate(-(-len(win) // engine.block_size))
        try:
            with torch.inference_mode():
                input_ids, positions, meta, _ = runner._prepare([ScheduledSeq(seq, len(win))])
                hidden = runner.model(input_ids, positions, runner.kv_cache, meta)
                logits = runner.model.compute_logits(hidden[:-1])  # (w-1, V) float32
            target = torch.tensor(win[1:])
            nll += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
            count += len(win) - 1
        finally:
            engine.pool.release(seq.block_table)
    return {"perplexity": float(torch.tensor(nll / count).exp()), "tokens": count, "windows": len(windows)}


# -- transformers ------------------------------------------------------------------------------
def run_transformers(spec: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(spec["threads"])
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=dtype).eval()

    def generate(prompts, n):
        ids = torch.tensor(prompts)  # equal lengths: no padding needed
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                           min_new_tokens=n, pad_token_id=0)

    return measure(generate, spec)


# -- vLLM --------------------------------------------------------------------------------------
def run_vllm(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_model_len=2048, seed=0,
              enable_prefix_caching=False, max_num_seqs=max(16, len(spec["batch"]["prompts"])))
    startup = time.perf_counter() - t0

    def generate(prompts, n):
        params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    out = measure(generate, spec)
    out["startup_s"] = startup
    import vllm

    out["vllm_version"] = vllm.__version__
    return out


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    run = {"brigade": run_brigade, "transformers": run_transformers, "vllm": run_vllm}[spec["system"]]
    result = run(spec)
    result["pid"] = os.getpid()
    print("\n" + MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
