"""Builders shared by the engine tests: tiny HF checkpoints, engines, prompts, run loops, and
model-free schedulers and sequences (make_scheduler, make_seqs, step).

Model sizes stay tiny (hidden 64, 2 layers, vocab 512) so the suite runs on two CPU cores.
"""
from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import torch

from engine import CacheConfig, EngineConfig, LLMEngine, RequestOutput, Role, SamplingParams, SchedulerConfig
from engine.block_pool import BlockPool
from engine.config import SpeculativeConfig
from engine.radix_cache import RadixCache
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence

VOCAB = 512
# Larger than transformers' default 0.02: with hidden 64 this gives logits of std ~1.5, so
# greedy argmax has clear margins (ties implausible) and output depends on the context.
INIT_STD = 0.2
_COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=INIT_STD,
    # No EOS anywhere: the engine and transformers both generate exactly max_new_tokens.
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)
# name -> (transformers class names, config overrides)
HF_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=False)),
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", dict(
        tie_word_embeddings=True, max_position_embeddings=512,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=True)),
    "qwen3-moe-unnormed": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        tie_word_embeddings=True, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        norm_topk_prob=False)),
}


def build_hf_model(name: str, seed: int = 0) -> torch.nn.Module:
    """A random-weight transformers model for HF_SPECS[name], deterministic in `seed`."""
    import transformers

    config_cls, model_cls, overrides = HF_SPECS[name]
    config = getattr(transformers, config_cls)(**{**_COMMON, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # transformers zeroes biases (Qwen2's q/k/v): make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(std=INIT_STD)
    return model


def save_hf_model(name: str, path: Path, seed: int = 0, **save_kwargs: Any) -> Path:
    build_hf_model(name, seed).save_pretrained(path, **save_kwargs)
    return path


def make_engine(model: str | Path, *, num_blocks: int = 256, block_size: int = 4, budget: int = 2048,
                max_num_seqs: int = 64, chunked: bool = True, prefix_cache: bool = True,
                role: Role = Role.MIXED, seed: int = 0, dtype: str = "float32",
                max_model_len: int | None = None, speculative: SpeculativeConfig | None = None) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=str(model), dtype=dtype, device="cpu", role=role, seed=seed, max_model_len=max_model_len,
        speculative=speculative or SpeculativeConfig(),
        cache=CacheConfig(num_blocks=num_blocks, block_size=block_size, enable_prefix_cache=prefix_cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                  enable_chunked_prefill=chunked),
    ))


def make_prompts(lengths: list[int], seed: int = 0, vocab: int = VOCAB) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = 16, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_all(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, RequestOutput]:
    """Step until the engine is idle; the final output of every request that finished."""
    done: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


def generate_one_by_one(engine: LLMEngine, prompts: list[list[int]],
                        params: list[SamplingParams]) -> list[list[int]]:
    return [engine.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]


def assert_pool_clean(engine: LLMEngine) -> None:
    """Nothing holds a block: every block is free or cached-and-evictable."""
    assert engine.pool.num_referenced == 0
    assert engine.pool.num_free == engine.pool.num_blocks
    assert not engine.has_unfinished()


@functools.cache
def tiny_model_id() -> str:
    """The model id engines of the `tiny` preset hash blocks with ("tiny@<fingerprint>")."""
    from engine.engine_setup import engine_model_id

    return engine_model_id(EngineConfig(model="tiny", dtype="float32"))


# -- model-free scheduler builders -------------------------------------------------------------

def make_scheduler(num_blocks: int = 16, block_size: int = 4, budget: int = 16, max_num_seqs: int = 8,
                   chunked: bool = True, prefix_cache: bool = True) -> Scheduler:
    """A Scheduler over a fresh BlockPool (and RadixCache): no model, exact block ids (the pool
    hands out free blocks in id order and takes released ones back at the end)."""
    pool = BlockPool(num_blocks)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked)
    return Scheduler(cfg, pool, RadixCache(pool) if prefix_cache else None, block_size, model_id="m")


def make_seqs(*lengths: int, prefix: list[int] = (), max_tokens: int = 8, start: int = 0) -> list[Sequence]:
    """Sequences `s<start>`, `s<start+1>`, ... whose prompts are `prefix` + `length` tokens of
    their own (distinct across sequences, so only `prefix` is ever shared)."""
    return [Sequence(f"s{start + i}", [*prefix, *range(1000 * (start + i + 1), 1000 * (start + i + 1) + n)],
                     SamplingParams(max_tokens=max_tokens), arrival=start + i) for i, n in enumerate(lengths)]


def step(sched: Scheduler, sampled: dict[str, int] | None = None) -> list[tuple[str, int, list[int]]]:
    """One scheduling step without a model: (request id, tokens computed, block table) per
    scheduled sequence; every sequence that reaches its end gets a token appended (7, or
    `sampled[id]`), as the engine would after sampling."""
    batch = sched.schedule()
    out = [(s.seq.request_id, s.num_new_tokens, list(s.seq.block_table)) for s in batch]
    sched.after_step(batch)
    for s in batch:
        if s.seq.num_computed == s.seq.num_tokens:
            s.seq.token_ids.append((sampled or {}).get(s.seq.request_id, 7))
    return out


def engine_prefill_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Full-vocabulary logits (V,) of the prompt's last position, straight from the model runner."""
    seq = Sequence("probe", list(prompt), SamplingParams(), arrival=0)
    seq.block_table = engine.pool.allocate(-(-len(prompt) // engine.block_size))
    try:
        return engine.runner.run([ScheduledSeq(seq, len(prompt))])[0]
    finally:
        engine.pool.release(seq.block_table)
