"""Speculative decoding benchmark: what proposing tokens and verifying them in one target pass buys.

Every ratio compares the same engine with speculation on and off, in ONE run, in the machine's
best precision (--dtype auto), greedy (so both sides emit the same tokens; the run checks it):

  draft_speedup_bs1     (target >= 2.0)
      Qwen2.5-Coder-1.5B-Instruct with Qwen2.5-Coder-0.5B-Instruct drafting (--speculative
      draft=qwen2.5-coder-0.5b,k=K,draft_quantization=int4: the draft's best precision here,
      --draft-quantization none for the draft in the target's dtype), batch 1: 8 code prompts,
      up to 128 tokens each (a request ends at its EOS), one after another; speculative output
      tokens/s / plain tokens/s (model loads excluded).
  ngram_speedup_bs1     (target >= 1.5)
      SmolLM2-135M-Instruct with prompt lookup (--speculative ngram,k=K,n=3), batch 1, on an
      input-grounded task: rewrite a given passage (its output copies long runs of its prompt),
      each request ending where the rewrite ends (EOS) or at 128 tokens.
  spec_throughput_b16   (target >= 0.95)
      Output tokens/s of 16 such rewrite requests submitted at once, prompt lookup on / off: at
      load speculation must not cost (the adaptive rule turns it off in compute-bound steps).

raw.disagg_draft_kv compares, disaggregated, the draft's prompt KV shipped from the prefill worker
(speculative.draft_kv ship) with the decode worker's draft computing it (recompute): {ship_s,
recompute_s} over the same requests one at a time and {concurrent_ship_s, concurrent_recompute_s}
with all submitted at once, on the random presets bench / bench-draft (cheap: seconds; see
benchmarks/_disagg_draft_kv.py).

raw.acceptance holds acceptance rate (accepted / proposed) and mean accepted tokens per
verification step per drafter and workload; raw also has per-phase times, token counts and
whether speculative output equalled plain output.

--quick (a smoke run, < 1 minute on a quiet machine once SmolLM2 is pulled): SmolLM2 only, 2
prompts x 48 tokens and 8 concurrent; draft_speedup_bs1 is then SmolLM2 drafting for itself, a
check of the path (not the real pair), and the file is spec_bench.quick.json. Models come from
the registry (`brigade models pull ...`; pulled on first use otherwise). A missed target prints
MISS and still exits 0. Timing is only meaningful on a quiet machine.
"""
from __future__ import annotations

import gc
import sys
import time
from dataclasses import dataclass

import torch

from benchmarks import _common as C
from benchmarks import _disagg_draft_kv as disagg_draft_kv
from benchmarks.harness.run import BenchRun, bench_args
from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams
from engine.config import SpeculativeConfig

NAME = "spec_bench"
TARGETS = {"draft_speedup_bs1": ">= 2.0", "ngram_speedup_bs1": ">= 1.5", "spec_throughput_b16": ">= 0.95"}

PASSAGES = [
    "The river town woke slowly. Fishermen pulled their boats onto the gravel, the baker opened his "
    "shutters, and a thin fog lifted from the water as the church bell rang seven times. By noon the "
    "market square was full of traders selling apples, wool and copper pots, and children ran between "
    "the stalls chasing a brown dog that had stolen a loaf of bread.",
    "Photosynthesis is the process by which green plants use sunlight to turn water and carbon dioxide "
    "into glucose and oxygen. It happens mostly in the leaves, inside small structures called "
    "chloroplasts, which contain the green pigment chlorophyll. The oxygen is released into the air "
    "and the glucose feeds the plant and is stored as starch.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait "
    "until the power light stops blinking. Then press and hold the reset button on the back for ten "
    "seconds with a paperclip. The router restarts with its factory settings and the default network "
    "name printed on the label underneath.",
    "The committee met on Tuesday to review the budget for the new library. Members agreed to move "
    "funds from the parking project to the children's section, to extend opening hours on weekends, "
    "and to ask the city for a grant to repair the roof before winter. The next meeting is planned "
    "for the first Monday of March.",
]
CODE_TASKS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function that counts the words in a text file and returns a dict of counts.",
    "Write a Python function binary_search(items, target) that returns the index or -1.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that parses a CSV line with quoted fields into a list of strings.",
]


@dataclass(frozen=True)
class Plan:
    target: str  # draft pair's target
    draft: str
    ngram_model: str
    code_prompts: int
    code_tokens: int
    rewrite_prompts: int
    rewrite_tokens: int
    concurrent: int
    k_draft: int
    k_ngram: int
    disagg_prompts: int  # raw.disagg_draft_kv: requests of disagg_prompt_tokens, disagg_tokens out
    disagg_prompt_tokens: int
    disagg_tokens: int


FULL = Plan("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b", C.REAL_MODEL, 8, 128, 4, 128, 16, 4, 6, 8, 512, 16)
QUICK = Plan(C.REAL_MODEL, C.REAL_MODEL, C.REAL_MODEL, 2, 48, 2, 48, 8, 4, 6, 2, 256, 8)


def make_engine(model: str, dtype: str, spec: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, cache=CacheConfig(enable_prefix_cache=False),
                                  speculative=spec or SpeculativeConfig()))


def chat(engine: LLMEngine, text: str) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def rewrite_prompts(engine: LLMEngine, n: int) -> list[list[int]]:
    return [chat(engine, "Rewrite the following passage exactly, only fixing punctuation if needed:\n\n" + p)
            for p in (PASSAGES * 4)[:n]]


def serial(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Batch 1: each prompt alone, one after another (after one warm-up request), each ending at
    its end of sequence or max_tokens, as a user's request does: text generated past the end of a
    rewrite is no longer grounded in its prompt (an earlier version ignored EOS and measured
    prompt lookup on the model's unrelated rambling after the rewrite)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    t0 = time.perf_counter()
    outs = [engine.generate([p], params)[0] for p in prompts]
    return _summary(outs, time.perf_counter() - t0)


def concurrent(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return _summary(outs, time.perf_counter() - t0)


def _summary(outs, wall: float) -> dict:
    tokens = sum(len(o.token_ids) for o in outs)
    draft = sum(o.usage.spec_draft_tokens for o in outs)
    accepted = sum(o.usage.spec_accepted_tokens for o in outs)
    steps = sum(o.usage.spec_steps for o in outs)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "draft_tokens": draft,
            "accepted_tokens": accepted, "verify_steps": steps,
            "acceptance_rate": accepted / draft if draft else None,
            "accepted_per_step": accepted / steps if steps else None,
            "output": [o.token_ids for o in outs]}


def compare(label: str, plain_fn, spec_fn) -> dict:
    """Run plain then speculative; each engine is built, measured and dropped in turn."""
    out = {}
    for side, fn in (("plain", plain_fn), ("spec", spec_fn)):
        print(f"- {label}: {side} ...", flush=True)
        watch = C.CpuWatch()
        out[side] = fn()
        out[side]["cpu"] = watch.stop()
        print(f"  {out[side]['tokens_per_s']:.1f} tok/s ({out[side]['wall_s']:.1f} s)"
              + (f", acceptance {out[side]['acceptance_rate']:.2f}, {out[side]['accepted_per_step']:.2f} "
                 "accepted/step" if out[side]["acceptance_rate"] is not None else ""), flush=True)
        gc.collect()
    out["tokens_equal"] = out["plain"].pop("output") == out["spec"].pop("output")
    if not out["tokens_equal"]:
        print(f"  WARNING: {label}: speculative output differs from plain (bf16 rounding can flip near-ties)")
    return out


def phase_ngram(plan: Plan, dtype: str) -> dict:
    """Prompt lookup on rewrite prompts, batch 1 and `concurrent` at once, against the plain engine."""
    ngram = SpeculativeConfig(method="ngram", k=plan.k_ngram, n=3)
    plain_engine = make_engine(plan.ngram_model, dtype)
    rewrites = rewrite_prompts(plain_engine, max(plan.rewrite_prompts, plan.concurrent))
    bs1 = compare(
        "prompt lookup, batch 1", lambda: serial(plain_engine, rewrites[: plan.rewrite_prompts], plan.rewrite_tokens),
        lambda: serial(make_engine(plan.ngram_model, dtype, ngram), rewrites[: plan.rewrite_prompts],
                       plan.rewrite_tokens))
    b16 = compare(
        f"prompt lookup, {plan.concurrent} concurrent",
        lambda: concurrent(plain_engine, rewrites[: plan.concurrent], plan.rewrite_tokens),
        lambda: concurrent(make_engine(plan.ngram_model, dtype, ngram), rewrites[: plan.concurrent],
                           plan.rewrite_tokens))
    return {"ngram_bs1": bs1, "ngram_b16": b16}


def phase_draft(plan: Plan, dtype: str, quantization: str) -> dict:
    """A draft model on code prompts, batch 1, against the plain target."""
    draft = SpeculativeConfig(method="draft", draft_model=plan.draft, k=plan.k_draft, draft_quantization=quantization)
    target = make_engine(plan.target, dtype)
    code = [chat(target, t) for t in CODE_TASKS[: plan.code_prompts]]
    return compare("draft model, batch 1", lambda: serial(target, code, plan.code_tokens),
                   lambda: serial(make_engine(plan.target, dtype, draft), code, plan.code_tokens))


def speedup(result: dict | None) -> float | None:
    return result["spec"]["tokens_per_s"] / result["plain"]["tokens_per_s"] if result else None


def main(argv: list[str] | None = None) -> int:
    ap = bench_args(__doc__, "smoke run (< 1 minute, SmolLM2 only); writes spec_bench.quick.json", threads=True)
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights and KV dtype (default auto: the machine's best)")
    ap.add_argument("--skip-draft", action="store_true", help="skip the Qwen draft-model pair (no 1.5 GB pull)")
    ap.add_argument("--draft-quantization", choices=["none", "int8", "int4"], default="int4",
                    help="the draft model's weights (default int4: the 0.5B's decode step is ~0.6x int8's on "
                         "a memory-bound CPU at the same acceptance; the target keeps --dtype)")
    args = ap.parse_args(argv)
    C.set_all_threads(args.threads)
    plan = QUICK if args.quick else FULL
    wanted = {plan.ngram_model, *(() if args.skip_draft else (plan.target, plan.draft))}
    models = {m: C.prepare_model(m) for m in wanted}
    run = BenchRun(NAME, TARGETS, args)
    run.plan(FULL, QUICK)
    print(f"{NAME}{' --quick' if args.quick else ''}: dtype {args.dtype}, {torch.get_num_threads()} torch threads")
    raw: dict = {"dtype": args.dtype, "draft_quantization": args.draft_quantization, "models": models,
                 **run.phase("prompt lookup", phase_ngram, plan, args.dtype)}
    if not args.skip_draft:
        raw["draft_bs1"] = run.phase("draft model", phase_draft, plan, args.dtype, args.draft_quantization)
    raw["disagg_draft_kv"] = run.phase("draft KV over a disaggregated pair", disagg_draft_kv.measure, args.dtype,
                                       plan.disagg_prompts, plan.disagg_prompt_tokens, plan.disagg_tokens)
    raw["acceptance"] = {
        f"{phase}:{label}": {"acceptance_rate": raw[phase]["spec"]["acceptance_rate"],
                             "accepted_per_step": raw[phase]["spec"]["accepted_per_step"]}
        for phase, label in (("ngram_bs1", "ngram/rewrite"), ("ngram_b16", "ngram/rewrite-concurrent"),
                             ("draft_bs1", "draft/code")) if phase in raw}
    ratios = {"ngram_speedup_bs1": speedup(raw["ngram_bs1"]), "spec_throughput_b16": speedup(raw["ngram_b16"]),
              "draft_speedup_bs1": speedup(raw.get("draft_bs1"))}
    return run.finish(ratios, **raw)


if __name__ == "__main__":
    sys.exit(main())
