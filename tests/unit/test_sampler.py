"""engine/sampler.py on hand-made logits, and SamplingParams validation."""
from __future__ import annotations

import math

import pytest
import torch

from engine import InvalidRequest, SamplingParams
from engine.sampler import Sampler

PROBS = [0.5, 0.3, 0.15, 0.05]  # a 4-token distribution with known filter boundaries


def make_sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.device("cpu"), seed)


def rows(probs: list[float], n: int) -> torch.Tensor:
    return torch.tensor(probs).log().repeat(n, 1)  # (n, V) logits whose softmax is `probs`


def draw(params: SamplingParams, logits: torch.Tensor, seed: int = 0) -> list[int]:
    tokens, _ = make_sampler(seed)(logits, [params] * len(logits), list(range(len(logits))))
    return tokens


def random_logits(n: int = 8, vocab: int = 100) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_is_argmax() -> None:
    logits = random_logits()
    assert draw(SamplingParams(temperature=0), logits) == logits.argmax(-1).tolist()


def test_top_k_one_is_greedy_whatever_the_temperature_or_seed() -> None:
    logits = random_logits()
    want = logits.argmax(-1).tolist()
    assert draw(SamplingParams(temperature=1.5, top_k=1), logits) == want
    assert draw(SamplingParams(temperature=0.7, top_k=1, seed=3), logits) == want


def test_tiny_top_p_keeps_only_the_top_token() -> None:
    logits = random_logits(200, 50) / 3  # flat enough that unfiltered sampling often misses argmax
    want = logits.argmax(-1).tolist()
    assert draw(SamplingParams(top_p=1e-6), logits) == want
    assert draw(SamplingParams(), logits) != want


@pytest.mark.parametrize("params, kept", [
    (SamplingParams(min_p=0.2), {0, 1, 2}),  # 0.05 < 0.2 * 0.5
    (SamplingParams(min_p=0.7), {0}),  # 0.3 < 0.35
    (SamplingParams(top_k=2), {0, 1}),
    (SamplingParams(top_p=0.8), {0, 1}),  # 0.5 + 0.3 reaches 0.8: token 2 is not needed
    (SamplingParams(top_p=0.81), {0, 1, 2}),
    (SamplingParams(top_k=3, min_p=0.4), {0, 1}),  # 0.15 < 0.4 * 0.5
])
def test_filters_keep_exactly_the_expected_tokens(params: SamplingParams, kept: set[int]) -> None:
    assert set(draw(params, rows(PROBS, 1000))) == kept


def test_empirical_distribution_matches_softmax() -> None:
    n = 2000
    for temperature, expect in [(1.0, PROBS), (0.5, [p * p / sum(q * q for q in PROBS) for p in PROBS])]:
        tokens = draw(SamplingParams(temperature=temperature), rows(PROBS, n))
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        # std of a frequency is <= sqrt(0.25 / 2000) ~ 0.011; 0.04 is > 3.5 sigma.
        torch.testing.assert_close(freq, torch.tensor(expect), atol=0.04, rtol=0)
    # min_p renormalises over the kept tokens.
    tokens = draw(SamplingParams(min_p=0.2), rows(PROBS, n))
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
    torch.testing.assert_close(freq, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=0.04, rtol=0)


def test_seeded_rows_depend_only_on_seed_and_position() -> None:
    flat = rows([0.25] * 4, 1)
    params = SamplingParams(seed=42)
    alone = [make_sampler(0)(flat, [params], [pos])[0][0] for pos in range(40)]
    # Other sampler seed, other rows in the batch, other row index: same tokens.
    other = random_logits(2, 4)
    batch = torch.cat([other[:1], flat, other[1:]])
    mixed = [make_sampler(7)(batch, [SamplingParams(), params, SamplingParams(temperature=0)], [0, pos, 0])[0][1]
             for pos in range(40)]
    assert mixed == alone
    assert len(set(alone)) == 4  # positions get different draws
    assert [make_sampler(0)(flat, [SamplingParams(seed=43)], [p])[0][0] for p in range(40)] != alone


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = rows([0.25] * 4, 50)
    assert draw(SamplingParams(), logits, seed=1) == draw(SamplingParams(), logits, seed=1)
    assert draw(SamplingParams(), logits, seed=1) != draw(SamplingParams(), logits, seed=2)


def test_logprobs_are_the_sorted_top_n_of_log_softmax() -> None:
    logits = random_logits(4, 100)
    lsm = torch.log_softmax(logits, dim=-1)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(logprobs=0, seed=1),
              SamplingParams(temperature=0), SamplingParams(temperature=0.5, logprobs=20, seed=2)]
    tokens, logprobs = make_sampler()(logits, params, [0, 0, 0, 0])
    assert logprobs[2] is None
    assert logprobs[1].top == [] and logprobs[1].token_id == tokens[1]
    for row, n in [(0, 5), (3, 20)]:
        lp = logprobs[row]
        assert lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(lsm[row, tokens[row]].item(), abs=1e-6)
        ids = [i for i, _ in lp.top]
        values = [v for _, v in lp.top]
        assert ids == lsm[row].topk(n).indices.tolist()
        assert values == sorted(values, reverse=True)
        assert values == pytest.approx(lsm[row, ids].tolist(), abs=1e-6)
    assert logprobs[0].top[0][0] == tokens[0]  # greedy: the chosen token is the top one
    assert logprobs[1].logprob == pytest.approx(lsm[1, tokens[1]].item(), abs=1e-6)


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(temperature=math.inf), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop=("",)), "stop"),
    (dict(stop=tuple("abcdefghijklmnopq")), "stop"),
])
def test_sampling_params_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}: ")


def test_sampling_params_edges_that_are_valid() -> None:
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams().greedy
    SamplingParams(top_p=1.0, top_k=-1, min_p=0.0, logprobs=0)
    SamplingParams(top_k=0, min_p=1.0, logprobs=20)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3.0]).stop == ("a", "b")


def test_top_k_alone_keeps_what_the_sorted_filter_keeps() -> None:
    """The top-k-only fast path (topk, no sort) against the general sorted path on the same rows."""
    from engine.sampler import _filter

    torch.manual_seed(0)
    logits = torch.randn(6, 1000)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 5, 50, 999, 0, 7)]
    fast = _filter(logits, params)
    # top_p just under 1 forces the sorted path without dropping anything a random row keeps
    slow = _filter(logits, [SamplingParams(temperature=1.0, top_k=p.top_k, top_p=1 - 1e-9) for p in params])
    assert torch.equal(fast.isinf(), slow.isinf())
    assert [int((~fast[i].isinf()).sum()) for i in range(6)] == [1, 5, 50, 999, 1000, 7]
