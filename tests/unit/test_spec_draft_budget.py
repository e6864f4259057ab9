"""The draft model's work in a step stays within the step's token budget (its prompt catch-up is
chunked across steps), and a drafter that fails never fails a request or the engine: greedy
tokens stay those of the engine without speculation. In-process on the `tiny` presets; the only
stand-ins wrap our own ModelRunner and Drafter."""
from __future__ import annotations

import logging

import pytest
from helpers import assert_pool_clean, greedy, make_engine, make_prompts, run_all

from engine import Role
from engine.config import SpeculativeConfig
from engine.spec.speculator import MAX_DRAFT_FAILURES

pytestmark = pytest.mark.usefixtures("torch_single_thread")

VOCAB = 4096  # the tiny preset's tokenizer
DRAFT = SpeculativeConfig(method="draft", draft_model="tiny-draft", k=3)
NGRAM = SpeculativeConfig(method="ngram", k=4, n=3, n_min=1)
POISONED = "r1"


class RecordingRunner:
    """The draft's ModelRunner: records each forward pass's token count, and raises instead of
    computing a pass that `fails` picks."""

    def __init__(self, inner, fails=lambda batch: False):
        self.inner, self.fails, self.passes = inner, fails, []

    def run(self, batch):
        self.passes.append(sum(s.num_new_tokens for s in batch))
        if self.fails(batch):
            raise RuntimeError("draft forward failed")
        return self.inner.run(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class PoisonedDrafter:
    """A Drafter that raises whenever it is asked to propose for the POISONED request."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, seqs, ks):
        if any(s.request_id == POISONED for s in seqs):
            raise ValueError("drafting this request's tokens failed")
        return self.inner.propose(seqs, ks)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def run(eng, prompt_list, max_tokens: int) -> list:
    for i, p in enumerate(prompt_list):
        eng.add_request(f"r{i}", p, greedy(max_tokens))
    done = run_all(eng)
    return [done[f"r{i}"] for i in range(len(prompt_list))]


def assert_clean(eng) -> None:
    assert_pool_clean(eng)
    drafter = eng.speculator.drafter
    if hasattr(drafter, "pool"):
        assert drafter.pool.num_referenced == 0 and drafter.pool.num_free == drafter.pool.num_blocks
        assert not drafter.mirrors


def short_prompts() -> list[list[int]]:
    out = make_prompts([5, 17, 30], seed=1, vocab=VOCAB)
    return out + [p * 3 for p in make_prompts([4, 6], seed=2, vocab=VOCAB)]


def long_prompts() -> list[list[int]]:
    return make_prompts([300, 280, 310, 290], seed=3, vocab=VOCAB)


def test_draft_catch_up_follows_the_prefill_within_the_step_budget() -> None:
    """Four long prompts with a 64-token step budget: no draft pass exceeds 64 tokens (the draft
    catches up on each prompt while the target prefills it, a budget's worth per step; without
    that one draft pass held every prompt at once), every request speculates, and the tokens
    are the plain engine's."""
    budget = 64
    want = [o.token_ids for o in run(make_engine("tiny", budget=budget, num_blocks=512), long_prompts(), 24)]
    eng = make_engine("tiny", budget=budget, num_blocks=512, speculative=DRAFT)
    draft = eng.speculator.drafter
    draft.runner = recorder = RecordingRunner(draft.runner)
    outs = run(eng, long_prompts(), 24)
    assert [o.token_ids for o in outs] == want
    assert max(recorder.passes) <= budget
    assert draft.computed_tokens >= sum(len(p) for p in long_prompts())  # every prompt was caught up
    assert all(o.usage.spec_steps > 0 for o in outs)
    assert_clean(eng)


def test_a_decode_engine_chunks_the_draft_catch_up_across_steps() -> None:
    """A decode engine gets the target's KV only: its draft computes each prompt at decode time,
    a budget's worth per step; a request decodes without proposals until its draft caught up."""
    budget = 64
    pre = make_engine("tiny", role=Role.PREFILL, num_blocks=512)
    for i, p in enumerate(long_prompts()):
        pre.add_request(f"r{i}", p, greedy(24))
    while pre.has_unfinished():
        pre.step()
    want = [o.token_ids for o in run(make_engine("tiny", budget=budget, num_blocks=512), long_prompts(), 24)]
    dec = make_engine("tiny", role=Role.DECODE, budget=budget, num_blocks=512, speculative=DRAFT)
    draft = dec.speculator.drafter
    draft.runner = recorder = RecordingRunner(draft.runner)
    for i in range(4):
        dec.import_kv(pre.export_kv(f"r{i}"), greedy(24))
    done = run_all(dec)
    assert [done[f"r{i}"].token_ids for i in range(4)] == want
    assert max(recorder.passes) <= budget
    assert all(done[f"r{i}"].usage.spec_steps > 0 for i in range(4))
    assert_clean(dec)
    assert_pool_clean(pre)


def test_aborting_requests_whose_draft_is_catching_up_frees_both_pools() -> None:
    eng = make_engine("tiny", budget=64, num_blocks=512, speculative=DRAFT)
    for i, p in enumerate(long_prompts()):
        eng.add_request(f"r{i}", p, greedy(24))
    for _ in range(6):  # mid-prefill: the draft holds part of some prompts
        eng.step()
    assert eng.speculator.drafter.mirrors
    for i in range(4):
        eng.abort(f"r{i}")
    assert_clean(eng)


def test_a_draft_forward_failing_for_one_request_leaves_the_rest_speculating(caplog) -> None:
    """Every draft pass holding the poisoned request raises: it decodes without proposals, each
    failure logged once with a log id, and stops drafting after MAX_DRAFT_FAILURES; the others
    speculate, and every request's tokens are the plain engine's."""
    want = [o.token_ids for o in run(make_engine("tiny"), short_prompts(), 20)]
    eng = make_engine("tiny", speculative=DRAFT)
    draft = eng.speculator.drafter
    draft.runner = RecordingRunner(draft.runner, lambda batch: any(s.seq.request_id == POISONED for s in batch))
    with caplog.at_level(logging.ERROR, logger="engine.spec.speculator"):
        outs = run(eng, short_prompts(), 20)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" for o in outs)
    assert outs[1].usage.spec_steps == 0
    assert all(o.usage.spec_steps > 0 for i, o in enumerate(outs) if i != 1)
    failures = [r for r in caplog.records if POISONED in r.getMessage()]
    assert len(failures) == MAX_DRAFT_FAILURES and all("log id" in r.getMessage() for r in failures)
    assert eng.stats()["spec_draft_failures"] == MAX_DRAFT_FAILURES and not eng.stats()["spec_drafter_off"]
    assert_clean(eng)


def test_a_drafter_raising_for_one_request_fails_no_request() -> None:
    """The same through the Drafter interface, with prompt lookup."""
    want = [o.token_ids for o in run(make_engine("tiny"), short_prompts(), 20)]
    eng = make_engine("tiny", speculative=NGRAM)
    eng.speculator.drafter = PoisonedDrafter(eng.speculator.drafter)
    outs = run(eng, short_prompts(), 20)
    assert [o.token_ids for o in outs] == want
    assert outs[1].usage.spec_steps == 0 and sum(o.usage.spec_steps for o in outs) > 0
    assert_pool_clean(eng)


def test_a_draft_model_failing_for_everyone_turns_speculation_off(caplog) -> None:
    """Every draft pass raises: no request proposes, none fails, the engine keeps stepping, and
    after MAX_DRAFT_FAILURES steps in a row speculation is off (logged once), so the draft is
    no longer tried."""
    want = [o.token_ids for o in run(make_engine("tiny"), short_prompts(), 20)]
    eng = make_engine("tiny", speculative=DRAFT)
    draft = eng.speculator.drafter
    draft.runner = recorder = RecordingRunner(draft.runner, lambda batch: True)
    with caplog.at_level(logging.ERROR, logger="engine.spec.speculator"):
        outs = run(eng, short_prompts(), 20)
    assert [o.token_ids for o in outs] == want
    assert all(o.finish_reason == "length" and o.usage.spec_steps == 0 for o in outs)
    assert eng.stats()["spec_drafter_off"]
    assert len([r for r in caplog.records if "speculative decoding is off" in r.getMessage()]) == 1
    tries = len(recorder.passes)
    eng.generate([short_prompts()[0]], greedy(8))
    assert len(recorder.passes) == tries  # off: the draft model runs no more
    assert_clean(eng)
