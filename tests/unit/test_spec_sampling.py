"""Speculative decoding keeps the target's distribution exactly (rejection sampling, engine/spec/
rejection.py) and a seeded request's tokens do not depend on its batch.

The exact marginals come from the tiny target itself: with top-k 4 every position has at most 4
candidates, so the distribution of output position 1 (after 4 first tokens) and of position 2
(after 4 x 4) is a sum over a few dozen forward passes. Chi-square goodness of fit, p > 0.01.
"""
from __future__ import annotations

import functools

import pytest
import torch
from helpers import build_hf_model, engine_prefill_logits, make_engine, run_all

from engine import SamplingParams
from engine.config import SpeculativeConfig
from engine.sampler import Sampler, target_probs
from engine.spec.drafter import Proposal
from engine.spec.rejection import verify

pytestmark = pytest.mark.usefixtures("torch_single_thread")

PROMPT = [11, 12, 13, 14, 11, 12, 13]
N_SAMPLES = 20_000
PARAMS = SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(target, draft) checkpoint dirs: the draft is the target with its weights perturbed, so it
    agrees with the target often but not always (every branch of the accept test runs)."""
    root = tmp_path_factory.mktemp("spec-models")
    model = build_hf_model("qwen3")
    model.save_pretrained(root / "target")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.03)
    model.save_pretrained(root / "draft")
    return root / "target", root / "draft"


class Oracle:
    """Filtered next-token distributions of a model, by context (cached forward passes)."""

    def __init__(self, path):
        self.engine = make_engine(path)

    @functools.cache  # noqa: B019 - one oracle per test
    def logits(self, context: tuple[int, ...]) -> torch.Tensor:
        return engine_prefill_logits(self.engine, list(context))

    @functools.cache  # noqa: B019
    def probs(self, context: tuple[int, ...]) -> torch.Tensor:
        return target_probs(self.logits(context)[None], [PARAMS])[0]



def marginal(target: Oracle, position: int, prompt: list[int]) -> torch.Tensor:
    """Exact distribution (V,) of output token `position` (0-based) under the target."""
    def walk(context: tuple[int, ...], weight: float, depth: int, out: torch.Tensor) -> None:
        p = target.probs(context)
        if depth == position:
            out += weight * p
            return
        for t in p.nonzero().flatten().tolist():
            walk(context + (t,), weight * float(p[t]), depth + 1, out)
    out = torch.zeros_like(target.logits(tuple(prompt)))
    walk(tuple(prompt), 1.0, 0, out)
    return out


def chi_square_p(samples: list[int], expected: torch.Tensor) -> float:
    """Goodness-of-fit p-value; bins expecting fewer than 5 samples are pooled."""
    counts = torch.bincount(torch.tensor(samples), minlength=expected.numel()).double()
    exp = expected.double() * len(samples)
    assert counts[exp == 0].sum() == 0, "a token the target cannot emit was emitted"
    big = exp >= 5
    obs_bins = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_bins = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = exp_bins > 0
    obs_bins, exp_bins = obs_bins[keep], exp_bins[keep]
    stat = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), torch.tensor(stat / 2.0)))


def test_engine_samples_the_target_distribution(models) -> None:
    """20,000 seeded requests in batches of 2,000, speculating (k = 2) from their second token on:
    output positions 1 (the first verified one) and 2 (later, inside a run or after it) fit the
    exact marginals. The draft proposes from its own distribution (the perturbed target)."""
    target = Oracle(models[0])
    prompt = PROMPT
    spec = SpeculativeConfig(method="draft", draft_model=str(models[1]), k=2, max_batch=1 << 16)
    eng = make_engine(models[0], num_blocks=8192, budget=16384, max_num_seqs=2000, speculative=spec)
    for i in range(N_SAMPLES):
        eng.add_request(f"r{i}", prompt, SamplingParams(temperature=1.0, top_k=4, max_tokens=4, ignore_eos=True,
                                                        seed=1000 + i))
    done = run_all(eng)
    outs = [done[f"r{i}"] for i in range(N_SAMPLES)]
    draft = sum(o.usage.spec_draft_tokens for o in outs)
    rate = sum(o.usage.spec_accepted_tokens for o in outs) / draft
    assert draft > N_SAMPLES // 2 and 0.1 < rate < 0.95  # accept and reject paths both ran often
    assert chi_square_p([o.token_ids[1] for o in outs], marginal(target, 1, prompt)) > 0.01
    assert chi_square_p([o.token_ids[2] for o in outs], marginal(target, 2, prompt)) > 0.01


@pytest.mark.parametrize("spec", [SpeculativeConfig(method="ngram", k=3, n=2, n_min=1, max_batch=2),
                                  SpeculativeConfig(method="draft", draft_model="tiny-draft", k=3, max_batch=2)],
                         ids=["ngram", "draft"])
def test_seeded_request_same_tokens_in_any_batch(spec) -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, ignore_eos=True, seed=7)
    prompt = [40, 41, 42, 43] * 4
    alone = make_engine("tiny", speculative=spec).generate([prompt], params)[0]
    eng = make_engine("tiny", speculative=spec, budget=64)  # chunked prefills beside it, a batch over max_batch
    others = [[50 + i, 60 + i, 70 + i] * (i + 1) for i in range(6)]
    for i, p in enumerate(others):
        eng.add_request(f"o{i}", p, SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True))
    eng.add_request("seeded", prompt, params)
    done = run_all(eng)
    assert done["seeded"].token_ids == alone.token_ids
    assert done["seeded"].usage.spec_steps > 0


def test_point_mass_proposals_keep_the_distribution() -> None:
    """Prompt lookup's proposals are point masses (q = 1): accept with p(d), else resample p without
    d. 20,000 verifications of two fixed proposals against fixed target rows: the first emitted
    token follows row 0 and the second row 1, whatever was accepted."""
    rows = torch.tensor([[0.4, 0.3, 0.2, 0.1, 0.0], [0.1, 0.6, 0.1, 0.1, 0.1], [0.2] * 5]).log()  # (3, V)
    expected = rows.softmax(-1)
    params = SamplingParams(temperature=1.0)
    sampler = Sampler(torch.device("cpu"), seed=4)
    firsts, seconds = [], []
    for _ in range(N_SAMPLES):
        run = verify(rows, None, Proposal([1, 3]), params, 0, sampler)
        if len(run) == 1:  # rejected at once: the next step verifies a fresh proposal from row 1
            run += verify(rows[1:], None, Proposal([4]), params, 1, sampler)
        firsts.append(run[0])
        seconds.append(run[1])
    assert chi_square_p(firsts, expected[0]) > 0.01
    assert chi_square_p(seconds, expected[1]) > 0.01
