"""Speculative decoding (engine/spec/) gives the tokens the engine gives without it, and frees
every block it takes: greedy, both drafters, with plain requests in the same batch, prefix
hits, chunking, preemption, abort, stops and max_tokens landing inside an accepted run."""
from __future__ import annotations

import pytest
from helpers import assert_pool_clean, greedy, make_engine, make_prompts, run_all

from engine import InvalidRequest, SamplingParams
from engine.config import EngineConfig, SpeculativeConfig
from engine.spec.adaptive import AdaptiveK, best_k
from engine.spec.ngram import lookup

pytestmark = pytest.mark.usefixtures("torch_single_thread")

VOCAB = 4096  # the tiny preset's tokenizer
DRAFTERS = {
    "ngram": SpeculativeConfig(method="ngram", k=4, n=3, n_min=1),
    "draft": SpeculativeConfig(method="draft", draft_model="tiny-draft", k=3),
    # The target drafting for itself: every greedy proposal is accepted (full runs, bonus tokens).
    "self-draft": SpeculativeConfig(method="draft", draft_model="tiny", k=4),
    # An int8 draft proposes differently; its proposals are verified, so the tokens are the same.
    "int8-draft": SpeculativeConfig(method="draft", draft_model="tiny-draft", k=3, draft_quantization="int8"),
    "int4-draft": SpeculativeConfig(method="draft", draft_model="tiny-draft", k=3, draft_quantization="int4"),
}


def prompts(n: int = 8, seed: int = 1) -> list[list[int]]:
    """Prompts with repeats, so prompt lookup finds matches, and random ones."""
    out = make_prompts([5, 17, 30, 9], seed=seed, vocab=VOCAB)
    out += [p * 3 for p in make_prompts([4, 6, 3, 7], seed=seed + 1, vocab=VOCAB)]
    return out[:n]


def engine(spec: SpeculativeConfig | None = None, **kw):
    return make_engine("tiny", speculative=spec, **kw)


def run(eng, prompt_list, params) -> list:
    for i, (p, sp) in enumerate(zip(prompt_list, params)):
        eng.add_request(f"r{i}", p, sp)
    done = run_all(eng)
    return [done[f"r{i}"] for i in range(len(prompt_list))]


def assert_clean(eng) -> None:
    assert_pool_clean(eng)
    drafter = eng.speculator.drafter
    if hasattr(drafter, "pool"):  # the draft model's own pool
        assert drafter.pool.num_referenced == 0 and drafter.pool.num_free == drafter.pool.num_blocks
        assert not drafter.mirrors


@pytest.fixture(scope="module")
def baseline():
    """Plain greedy tokens of prompts() (max_tokens 20), one engine for all."""
    return [o.token_ids for o in run(engine(), prompts(), [greedy(20)] * 8)]


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_identical_in_a_mixed_batch(name, baseline) -> None:
    eng = engine(DRAFTERS[name], budget=32, max_num_seqs=8)
    # Every other request opts out: speculating and plain decodes share each step.
    params = [greedy(20, speculate=i % 2 == 0) for i in range(8)]
    outs = run(eng, prompts(), params)
    assert [o.token_ids for o in outs] == baseline
    assert all(o.usage.spec_draft_tokens == 0 for o in outs[1::2])
    assert sum(o.usage.spec_steps for o in outs[::2]) > 0
    if name == "self-draft":
        assert all(o.usage.spec_accepted_tokens == o.usage.spec_draft_tokens > 0 for o in outs[::2])
        assert all(o.usage.spec_accepted_per_step > 1 for o in outs[::2])
    assert_clean(eng)


@pytest.mark.parametrize("name", ["ngram", "draft"])
def test_greedy_identical_with_prefix_hits(name, baseline) -> None:
    eng = engine(DRAFTERS[name])
    run(eng, prompts(), [greedy(20)] * 8)  # fills both prefix caches
    outs = run(eng, prompts(), [greedy(20)] * 8)
    assert [o.token_ids for o in outs] == baseline
    assert sum(o.usage.cached_tokens for o in outs) > 0
    if name == "draft":
        assert eng.speculator.drafter.cache.stats.hit_blocks > 0
    assert_clean(eng)


@pytest.mark.parametrize("name", ["ngram", "self-draft"])
def test_greedy_identical_under_preemption(name, baseline) -> None:
    eng = engine(DRAFTERS[name], num_blocks=40, prefix_cache=False)
    outs = run(eng, prompts(), [greedy(20)] * 8)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == baseline
    assert_clean(eng)


@pytest.mark.parametrize("name", ["ngram", "draft", "self-draft"])
def test_abort_mid_run_frees_both_pools(name, baseline) -> None:
    eng = engine(DRAFTERS[name])
    for i, p in enumerate(prompts()):
        eng.add_request(f"r{i}", p, greedy(20))
    for _ in range(3):
        eng.step()
    assert eng.speculator.drafter.stats().get("draft_requests", 1) > 0
    for i in range(0, 8, 2):
        assert eng.abort(f"r{i}").finish_reason == "abort"
    done = run_all(eng)
    assert [done[f"r{i}"].token_ids for i in range(1, 8, 2)] == baseline[1::2]
    assert_clean(eng)


def test_stops_and_max_tokens_inside_an_accepted_run(baseline) -> None:
    """With the self-draft every proposal is accepted, so each stop lands inside a run."""
    plain, spec = engine(), engine(DRAFTERS["self-draft"])
    p = prompts()[4]
    ref = plain.generate([p], greedy(20))[0]
    stop_token = ref.token_ids[7]
    text = ref.text
    cases = [greedy(20, stop_token_ids=(stop_token,)), greedy(6), SamplingParams(temperature=0.0, max_tokens=20),
             SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(text[len(text) // 2:][:3],))]
    for params in cases:
        want, got = plain.generate([p], params)[0], spec.generate([p], params)[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
    assert_clean(spec)


def test_logprobs_match_without_speculation() -> None:
    plain, spec = engine(), engine(DRAFTERS["self-draft"])
    params = greedy(12, logprobs=3)
    want, got = plain.generate([prompts()[1]], params)[0], spec.generate([prompts()[1]], params)[0]
    assert got.token_ids == want.token_ids
    assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got.logprobs] == \
           [(lp.token_id, [t for t, _ in lp.top]) for lp in want.logprobs]
    assert [lp.logprob for lp in got.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)


def test_decode_role_speculates_from_its_first_step(baseline) -> None:
    """A decode engine gets the target's KV only: the draft prefills the prompt itself."""
    from engine import Role

    pre, dec = engine(role=Role.PREFILL), engine(DRAFTERS["draft"], role=Role.DECODE)
    assert pre.speculator is None
    for i, p in enumerate(prompts()):
        pre.add_request(f"r{i}", p, greedy(20))
    while pre.has_unfinished():
        pre.step()
    for i in range(8):
        dec.import_kv(pre.export_kv(f"r{i}"), greedy(20))
    done = run_all(dec)
    assert [done[f"r{i}"].token_ids for i in range(8)] == baseline
    assert all(done[f"r{i}"].usage.spec_steps > 0 for i in range(8))
    assert_clean(dec)
    assert_pool_clean(pre)


def test_shipped_draft_kv_lets_the_decode_draft_skip_the_prompt(baseline) -> None:
    """speculative.draft_kv "ship": the prefill engine's own draft computes the prompt's draft KV,
    which goes with the target's; the decode engine's draft adopts it and computes no prompt."""
    from engine import Role

    ship = DRAFTERS["draft"].model_copy(update={"draft_kv": "ship"})
    pre, dec = engine(ship, role=Role.PREFILL), engine(ship, role=Role.DECODE)
    assert pre.speculator is None and pre.draft_kv is not None and dec.draft_kv is dec.speculator.drafter
    for round_ in range(2):  # the second round hits the prefill side's draft prefix cache
        for i, p in enumerate(prompts()):
            pre.add_request(f"r{round_}-{i}", p, greedy(20))
        while pre.has_unfinished():
            pre.step()
        for i, p in enumerate(prompts()):
            export = pre.export_kv(f"r{round_}-{i}")
            assert export.draft_kv is not None and export.draft_kv.shape[2] == -(-len(p) // pre.block_size)
            dec.import_kv(export, greedy(20))
            assert dec.draft_kv.mirrors[f"r{round_}-{i}"].num_computed == len(p)  # nothing left to catch up
        done = run_all(dec)
        assert [done[f"r{round_}-{i}"].token_ids for i in range(8)] == baseline
        assert all(done[f"r{round_}-{i}"].usage.spec_steps > 0 for i in range(8))
        assert_clean(dec)
    assert pre.draft_kv.cache.stats.hit_blocks > 0
    assert_pool_clean(pre)
    assert pre.draft_kv.pool.num_referenced == 0 and pre.stats()["draft_requests"] == 0


def test_draft_kv_recompute_and_aborted_reservations_leak_nothing() -> None:
    from engine import Role

    recompute = DRAFTERS["draft"].model_copy(update={"draft_kv": "recompute"})
    assert engine(recompute, role=Role.PREFILL).draft_kv is None
    assert engine(recompute, role=Role.DECODE).draft_kv is None
    dec = engine(DRAFTERS["draft"], role=Role.DECODE)
    for rid in ("a", "b"):
        dec.reserve(rid, 9)
        assert dec.reserve_draft(rid, 9) is not None and dec.stats()["draft_requests"] == 1
        assert dec.abort(rid) is None  # a reservation only: both pools whole again
        assert_clean(dec)


def test_large_batches_do_not_speculate() -> None:
    eng = engine(DRAFTERS["ngram"].model_copy(update={"max_batch": 2}))
    outs = run(eng, prompts(), [greedy(20)] * 8)
    # Until the batch drains to two running requests, nobody speculates.
    assert sum(o.usage.spec_steps for o in outs) < sum(o.usage.completion_tokens for o in outs) // 4


def test_k_shrinks_when_proposals_are_rejected() -> None:
    """tiny-draft is a different random model: its greedy guesses almost never match."""
    eng = engine(DRAFTERS["draft"])
    out = run(eng, prompts(1), [greedy(60)])[0]
    assert out.usage.spec_acceptance_rate < 0.2
    assert out.usage.spec_draft_tokens < 3 * 59 / 2  # k = 3 at first, then down to 0 with probes


def test_best_k_rule() -> None:
    assert best_k(0.0, 4, 0.1) == 0
    assert best_k(0.3, 4, 0.1) in (1, 2)
    assert best_k(0.95, 8, 0.1) >= 5
    assert best_k(1.0, 8, 0.0) == 8
    policy = AdaptiveK(SpeculativeConfig(method="ngram", k=4))
    for _ in range(6):
        policy.update("r", 4, 0)
    assert [policy.k_for("r") for _ in range(8)] == [0] * 7 + [1]  # a probe every 8 steps


def test_ngram_lookup() -> None:
    assert lookup([1, 2, 3, 4, 1, 2], 3, 1, 3) == [3, 4, 1]
    assert lookup([1, 2, 3, 4, 9, 2], 3, 1, 3) == [3, 4, 9]  # unigram 2
    assert lookup([1, 2, 3, 4, 9, 2], 3, 2, 3) == []
    assert lookup([7], 3, 1, 3) == []
    assert lookup([5, 1, 2, 6, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1]  # the latest occurrence


def test_speculative_flag_and_config_errors() -> None:
    assert SpeculativeConfig.from_flag("draft=tiny-draft,k=5") == SpeculativeConfig(
        method="draft", draft_model="tiny-draft", k=5)
    assert SpeculativeConfig.from_flag("ngram,k=4,n=3") == SpeculativeConfig(method="ngram", k=4, n=3)
    assert SpeculativeConfig.from_flag("draft=tiny-draft,draft_quantization=int8").draft_quantization == "int8"
    for bad in ("draft", "ngram,k=0", "ngram,x=1", "bogus", "ngram,draft_model=tiny"):
        with pytest.raises(ValueError, match="speculative"):
            SpeculativeConfig.from_flag(bad)
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(InvalidRequest, match="speculate"):
        SamplingParams(speculate="no")


def test_draft_model_with_another_vocabulary_is_refused(hf_checkpoints) -> None:
    path = hf_checkpoints.get("qwen3")  # vocabulary 512, tiny-draft 4096
    from engine import LLMEngine

    with pytest.raises(ValueError, match="vocabulary"):
        LLMEngine(EngineConfig(model=str(path), dtype="float32", device="cpu",
                               speculative=SpeculativeConfig(method="draft", draft_model="tiny-draft")))


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_a_quantized_draft_is_quantized_and_the_target_is_not(quant) -> None:
    from engine.quant.linear import Int4Linear, Int8Linear

    kind = {"int8": Int8Linear, "int4": Int4Linear}[quant]
    eng = engine(DRAFTERS[f"{quant}-draft"])
    kinds = lambda model: {type(m) for m in model.modules()}  # noqa: E731
    assert kind in kinds(eng.speculator.drafter.runner.model)
    assert not kinds(eng.runner.model) & {Int8Linear, Int4Linear}
