"""The engine against transformers, the reference implementation (DESIGN.md: same answer everywhere).

Random-weight checkpoints written by transformers' own save_pretrained: Llama with GQA
(untied), Llama with llama3 rope scaling (tied), Qwen2 (q/k/v bias, untied), Qwen3 (q/k norm, tied) and Qwen3-MoE (4
experts, top-2, with and without norm_topk_prob). float32 throughout.

Tolerances: logits and log-probs agree to atol 1e-4 (observed ~1e-5: the same ops in a
different order, e.g. paged attention vs a dense causal mask). Greedy tokens agree exactly;
the init (std 0.2, logits std ~1.5) makes argmax margins far larger than that error.
"""
from __future__ import annotations

import json

import pytest
import torch
from helpers import HF_SPECS, VOCAB, engine_prefill_logits, greedy, make_engine, make_prompts
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT_LENGTHS = [1, 3, 7, 16, 17, 31, 64, 100]  # around block boundaries (block_size 4 and 16)
NEW_TOKENS = 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(PROMPT_LENGTHS, seed=1)


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from transformers' generate() and the log-probs (n, V) at each step."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                             output_logits=True, return_dict_in_generate=True)
    logprobs = torch.stack([torch.log_softmax(step[0].float(), dim=-1) for step in out.logits])
    return out.sequences[0, len(prompt):].tolist(), logprobs


@pytest.mark.parametrize("name", sorted(HF_SPECS))
def test_greedy_tokens_and_logprobs_match_transformers(name, hf_checkpoints, prompts) -> None:
    path = hf_checkpoints.get(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, block_size=4)
    outs = engine.generate(prompts, greedy(NEW_TOKENS, logprobs=20))

    for prompt, out in zip(prompts, outs):
        want, hf_lp = hf_greedy(hf, prompt, NEW_TOKENS)
        assert out.token_ids == want, f"prompt of {len(prompt)} tokens"
        assert out.finish_reason == "length"
        # Each step's top-20: ours are sorted, have HF's values at those ids, and are HF's top 20.
        for step, lp in enumerate(out.logprobs):
            ids = [i for i, _ in lp.top]
            ours = torch.tensor([v for _, v in lp.top])
            assert len(ids) == 20 and lp.token_id == want[step] == ids[0]
            assert torch.all(ours[:-1] >= ours[1:])
            torch.testing.assert_close(ours, hf_lp[step, ids], atol=ATOL, rtol=0)
            assert ours[-1] >= hf_lp[step].topk(20).values[-1] - ATOL
            assert lp.logprob == pytest.approx(hf_lp[step, want[step]].item(), abs=ATOL)
    # Not degenerate: the comparison means something only if outputs vary.
    all_tokens = [t for out in outs for t in out.token_ids]
    assert len(set(all_tokens)) > 40
    assert len({tuple(out.token_ids) for out in outs}) == len(prompts)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-moe"])
def test_prefill_logits_match_transformers(name, hf_checkpoints, prompts) -> None:
    path = hf_checkpoints.get(name)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = make_engine(path, block_size=16)
    for prompt in prompts:
        with torch.no_grad():
            want = hf(torch.tensor([prompt])).logits[0, -1].float()  # (V,)
        got = engine_prefill_logits(engine, prompt)
        assert got.shape == (VOCAB,)
        assert want.std() > 0.5  # peaked, not flat
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert engine.pool.num_referenced == 0


def test_sharded_checkpoint_loads_and_gives_the_same_tokens(hf_checkpoints, prompts) -> None:
    single = hf_checkpoints.get("qwen3-moe")
    sharded = hf_checkpoints.get("qwen3-moe", "sharded", max_shard_size="100KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 2 and not (sharded / "model.safetensors").exists()
    # Experts of one layer are spread over several files.
    assert len({f for k, f in index["weight_map"].items() if ".layers.0.mlp.experts." in k}) > 1

    params = greedy(8)
    want = [o.token_ids for o in make_engine(single).generate(prompts, params)]
    got = [o.token_ids for o in make_engine(sharded).generate(prompts, params)]
    assert got == want


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3-moe"])
def test_bfloat16_load_smoke(name, hf_checkpoints, prompts) -> None:
    engine = make_engine(hf_checkpoints.get(name), dtype="bfloat16")
    assert engine.dtype == torch.bfloat16
    assert engine.runner.kv_cache.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in engine.runner.model.parameters())
    logits = engine_prefill_logits(engine, prompts[-1])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    outs = engine.generate(prompts[:4], greedy(8))
    for out in outs:
        assert len(out.token_ids) == 8 and all(0 <= t < VOCAB for t in out.token_ids)
