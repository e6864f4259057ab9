"""A prompt's text costs the doors a bounded, GIL-free tokenization: text longer than the
model's context could hold is refused before it is tokenized, long text is encoded with the GIL
released (the process's other threads go on meanwhile), and the doors tokenize at most a few
long texts at once (router/tokenize_slots.py), refusing more than the waiting room holds."""
from __future__ import annotations

import threading
import time

import pytest

from engine.presets import ASSETS
from engine.sampling import InvalidRequest
from engine.tokenizer import GIL_FREE_ABOVE_CHARS, Tokenizer, chat_token_ids, prompt_token_ids
from router.errors import Overloaded
from router.tokenize_slots import TokenizeSlots

WORDS = "the quick brown fox jumps over a lazy dog while naïve cafés hum 1234 ".split()


def words(chars: int) -> str:
    out = " ".join(WORDS[i % len(WORDS)] + str(i % 97) for i in range(chars // 4 + 1))
    return out[:chars]


class Recording:
    """The HF tokenizer, recording which of its encode paths each call took."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode(self, text, **kw):
        self.calls.append(("encode", len(text)))
        return self.tok.encode(text, **kw)

    def encode_batch(self, texts, **kw):
        self.calls.append(("encode_batch", sum(map(len, texts))))
        return self.tok.encode_batch(texts, **kw)


@pytest.fixture
def tok() -> Tokenizer:
    return Tokenizer(ASSETS / "bpe-4k")


def test_text_over_the_context_is_refused_before_it_is_tokenized(tok: Tokenizer) -> None:
    tok.limit(max_model_len=10)
    assert tok.max_text_chars == 10 * tok.max_token_chars
    spy = tok._tok = Recording(tok._tok)
    with pytest.raises(InvalidRequest, match=f"more than the {tok.max_text_chars:,}") as err:
        prompt_token_ids(tok, "x" * (tok.max_text_chars + 1))
    assert err.value.field == "prompt" and spy.calls == []
    assert len(prompt_token_ids(tok, "x" * tok.max_text_chars)) > 0  # at the bound: tokenized


def test_the_bound_holds_every_text_the_context_can_hold(tok: Tokenizer) -> None:
    """The longest entries, repeated max_model_len times, spell the longest text that fits."""
    longest = max(tok._tok.get_vocab(), key=len)
    text = tok.decode([tok._tok.token_to_id(longest)] * 50, skip_special_tokens=False)
    tok.limit(max_model_len=50)
    assert len(text) <= tok.max_text_chars
    assert len(tok.encode(text)) <= 50


def test_a_rendered_chat_over_the_context_is_refused_naming_messages(tok: Tokenizer) -> None:
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tok.limit(max_model_len=8)
    with pytest.raises(InvalidRequest) as err:
        chat_token_ids(tok, [{"role": "user", "content": "y" * (tok.max_text_chars + 1)}])
    assert err.value.field == "messages"
    assert chat_token_ids(tok, [{"role": "user", "content": "hi"}])


def test_long_text_takes_the_gil_free_path_and_short_text_the_direct_one(tok: Tokenizer) -> None:
    spy = tok._tok = Recording(tok._tok)
    short, long = words(GIL_FREE_ABOVE_CHARS), words(GIL_FREE_ABOVE_CHARS + 1)
    want = [Recording.encode(spy, t, add_special_tokens=False).ids for t in (short, long)]
    spy.calls.clear()
    assert [tok.encode(short), tok.encode(long)] == want  # the same ids either way
    assert spy.calls == [("encode", len(short)), ("encode_batch", len(long))]


def test_a_long_encode_does_not_freeze_the_other_threads(tok: Tokenizer) -> None:
    """A ticker that sleeps 10 ms keeps ticking while 4 M characters are tokenized (the direct
    path held the GIL for the whole encode: seconds without a tick)."""
    text = words(4_000_000)
    stop, at = threading.Event(), []  # the ticker's tick times

    def tick() -> None:
        while not stop.is_set():
            time.sleep(0.01)
            at.append(time.perf_counter())

    ticker = threading.Thread(target=tick)
    ticker.start()
    time.sleep(0.05)
    start = time.perf_counter()
    ids = tok.encode(text)
    end = time.perf_counter()
    stop.set()
    ticker.join()
    assert len(ids) > 100_000
    # The ticker ran in both halves of the encode: the GIL was free all along, not only at its
    # ends. (How long one gap is depends on what else the cores run: a figure, not this test's.)
    middle = (start + end) / 2
    halves = [sum(start <= t < middle for t in at), sum(middle <= t <= end for t in at)]
    assert min(halves) >= 3, f"ticks in each half of a {end - start:.2f} s encode: {halves}"


def test_the_slots_bound_long_tokenizations_and_the_waiting_room(tok: Tokenizer) -> None:
    slots = TokenizeSlots(running=1, waiting=1)
    tok.limit(max_model_len=1 << 20, long_text_gate=slots)
    entered, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=lambda: (slots.__enter__(), entered.set(), release.wait(), slots.__exit__()))
    holder.start()
    entered.wait(5)
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: waited.append(len(tok.encode(words(GIL_FREE_ABOVE_CHARS + 10)))))
    waiter.start()
    deadline = time.monotonic() + 5
    while slots._queued == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert slots._queued == 1 and waited == []  # the second long text waits for the slot
    with pytest.raises(Overloaded, match="1 long prompts are being tokenized and 1 more wait"):
        tok.encode(words(GIL_FREE_ABOVE_CHARS + 10))  # the third: no room, refused at once
    assert tok.encode("a short text takes no slot")
    release.set()
    holder.join(5)
    waiter.join(5)
    assert waited and waited[0] > 0 and slots._queued == 0
    with slots:  # every slot was given back
        pass
