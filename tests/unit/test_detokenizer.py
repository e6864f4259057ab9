"""Text equals the tokens: at finish a request's text is tokenizer.decode(its output ids), as
transformers decodes them, replacement characters included; the stream's deltas concatenate to
it; and the incremental detokenizer decodes a bounded window per token, not the whole output."""
from __future__ import annotations

import pytest
from helpers import greedy, make_engine

from engine import SamplingParams
from engine.presets import resolve_model
from engine.tokenizer import IncrementalDetokenizer, Tokenizer

pytestmark = pytest.mark.usefixtures("torch_single_thread")


class CountingTokenizer:
    """Our Tokenizer, recording how many ids each decode() call was given."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.calls = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.calls.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def incomplete_tail_ids(tok: Tokenizer) -> list[int]:
    """Tokens whose text alone is an incomplete UTF-8 sequence (byte-level BPE byte tokens)."""
    return [i for i in range(tok.vocab_size) if tok.decode([i]).endswith("\ufffd")]


def test_one_token_answers_ending_inside_a_character_keep_their_text() -> None:
    """Of 200 one-token greedy answers on tiny, none comes back '' where decode gives '\\ufffd'."""
    engine = make_engine("tiny", num_blocks=512, block_size=16)
    tok = engine.tokenizer
    prompts = [[(7 * i + 3 * j) % 4000 + 3 for j in range(1 + i % 9)] for i in range(200)]
    outs = engine.generate(prompts, greedy(1))
    texts = [(o.text, tok.decode(o.token_ids)) for o in outs]
    assert all(got == want for got, want in texts)
    assert sum("\ufffd" in want for _, want in texts) > 0  # the case this is about did occur


def test_streamed_deltas_concatenate_to_the_decoded_tokens() -> None:
    engine = make_engine("tiny", num_blocks=512, block_size=16)
    tok = engine.tokenizer
    bad = incomplete_tail_ids(tok)
    assert bad
    for i, n in enumerate([1, 2, 5, 40]):
        engine.add_request(f"r{i}", [bad[i % len(bad)], 100 + i, bad[(3 * i) % len(bad)]],
                           SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True))
    deltas: dict[str, list[str]] = {}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            deltas.setdefault(out.request_id, []).append(out.new_text)
            if out.finished:
                final[out.request_id] = out
    for rid, out in final.items():
        assert out.text == "".join(deltas[rid]) == tok.decode(out.token_ids)


def test_detokenizer_flushes_an_unfinished_character_and_decodes_a_bounded_window() -> None:
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    bad = incomplete_tail_ids(tok)
    ids = [t for i in range(300) for t in ((bad[i % len(bad)],) if i % 7 == 3 else tok.encode(f" w{i}"))]
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting)
    streamed = []
    for n in range(1, len(ids) + 1):
        detok.update(ids[:n])
        streamed.append(detok.take())
    detok.finish()
    streamed.append(detok.take())
    assert detok.text == "".join(streamed) == tok.decode(ids)
    # Two decodes of a few tokens each per update, however long the output grows.
    assert len(counting.calls) <= 2 * len(ids) + 2 and max(counting.calls) <= 4


def test_a_continuation_resumes_from_its_prefix_with_a_bounded_window() -> None:
    tok = Tokenizer.from_dir(resolve_model("tiny"))
    prefix = tok.encode(" the quick brown fox" * 20)
    counting = CountingTokenizer(tok)
    detok = IncrementalDetokenizer(counting, prefix, emitted=len(tok.decode(prefix)))
    more = tok.encode(" jumps over")
    counting.calls.clear()
    for n in range(1, len(more) + 1):
        detok.update(more[:n])
    assert detok.take() == " jumps over" and max(counting.calls) <= len(prefix) + 2
    assert max(counting.calls[2:]) <= 4  # after the first step, windows are a few tokens
