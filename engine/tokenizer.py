"""The checkpoint's tokenizer (tokenizer.json) and chat template, plus incremental detokenizing."""
from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.chat_template import TemplateRefused, render
from engine.sampling import InvalidRequest

# Texts longer than this are encoded with the GIL released (HF tokenizers' encode_batch releases
# it, encode does not): a long prompt is tokenized while the process's other threads, the front
# doors' health answers among them, go on. Shorter texts take the direct path, done in a millisecond.
GIL_FREE_ABOVE_CHARS = 4096


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        # What transformers' special_tokens_map hands a chat template (only the ones set).
        self.special_tokens = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (t := _token_text(cfg.get(k)))}
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        # The longest vocabulary entry, in characters: no token spells more text than this (a
        # byte-level or "##" entry is longer than the text it stands for, so this errs high).
        self.max_token_chars = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)
        self.max_text_chars: int | None = None  # set by limit()
        self.long_text_gate: contextlib.AbstractContextManager = contextlib.nullcontext()

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        """None when the checkpoint ships no tokenizer (token-id prompts still work)."""
        return cls(path) if (path / "tokenizer.json").is_file() else None

    def limit(self, max_model_len: int, long_text_gate: contextlib.AbstractContextManager | None = None) -> None:
        """From now on refuse, before encoding it, a text longer than `max_model_len` tokens could
        spell (max_model_len x max_token_chars characters), and hold `long_text_gate` (e.g. a
        bounded count of tokenizations at once) around each encode of a long text."""
        self.max_text_chars = max_model_len * self.max_token_chars
        if long_text_gate is not None:
            self.long_text_gate = long_text_gate

    def encode(self, text: str, field: str = "prompt") -> list[int]:
        """Token ids of `text`; InvalidRequest naming `field` (the request field the text came
        from) when it is longer than limit() allows."""
        if self.max_text_chars is not None and len(text) > self.max_text_chars:
            raise InvalidRequest(field, f"is {len(text):,} characters of text, more than the {self.max_text_chars:,} "
                                        f"the model's context can hold (max_model_len tokens of at most "
                                        f"{self.max_token_chars} characters each); send a shorter text")
        if len(text) <= GIL_FREE_ABOVE_CHARS:
            return self._tok.encode(text, add_special_tokens=False).ids
        with self.long_text_gate:
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            variables: dict | None = None, **kwargs) -> str:
        """The template's text, as transformers' apply_chat_template(..., tokenize=False) gives it;
        TemplateRefused if the template raises. `variables` (and `kwargs`) are the template's own."""
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; send a plain prompt")
        return render(self.chat_template, messages, tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, special_tokens=self.special_tokens,
                      variables={**kwargs, **(variables or {})})


def prompt_token_ids(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as token ids: text goes through the tokenizer, ids pass through as ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("prompt", "this model has no tokenizer.json: send token ids")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def _is_message(m: object) -> bool:
    if not (isinstance(m, dict) and isinstance(m.get("role"), str)):
        return False
    content = m.get("content")
    return isinstance(content, str) or (content is None and "tool_calls" in m)


def _chat_inputs(messages: object, tools: object, documents: object, template_kwargs: object) -> dict:
    """The chat request's template inputs, checked: the caller's variables as a fresh dict."""
    if not isinstance(messages, list) or not messages or not all(map(_is_message, messages)):
        raise InvalidRequest("messages", "must be a non-empty list of {\"role\": str, \"content\": str} "
                                         "(content may be null on a message with tool_calls)")
    for name, value in (("tools", tools), ("documents", documents)):
        if value is not None and not (isinstance(value, list) and all(isinstance(v, dict) for v in value)):
            raise InvalidRequest(name, "must be a list of JSON objects")
    if template_kwargs is None:
        return {}
    if not isinstance(template_kwargs, dict) or not all(isinstance(k, str) for k in template_kwargs):
        raise InvalidRequest("chat_template_kwargs", "must be a JSON object of template variables")
    return dict(template_kwargs)


def chat_token_ids(tokenizer: Tokenizer | None, messages: object, tools: object = None, documents: object = None,
                   template_kwargs: object = None) -> list[int]:
    """Chat messages ([{"role", "content", ...}, ...]) through the model's chat template, as token
    ids. `tools` and `documents` (lists of JSON objects) and `template_kwargs` (an object: the
    OpenAI request's chat_template_kwargs, e.g. {"enable_thinking": false}) reach the template
    as transformers passes them. InvalidRequest naming the field for malformed input; field
    "messages" when the template itself refuses them (its raise_exception)."""
    kwargs = _chat_inputs(messages, tools, documents, template_kwargs)
    if tokenizer is None or not tokenizer.chat_template:
        raise InvalidRequest("messages", "this model has no chat template: send a plain prompt instead")
    add_generation_prompt = kwargs.pop("add_generation_prompt", True)
    # As transformers does: a key set to null is a key left out (templates test `is defined`).
    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        text = tokenizer.apply_chat_template(plain, add_generation_prompt=bool(add_generation_prompt),
                                             tools=tools, documents=documents, variables=kwargs)
    except TemplateRefused as exc:
        raise InvalidRequest(exc.field, f"the chat template refused the {exc.field}: {exc}") from None
    return tokenizer.encode(text, "messages")


class IncrementalDetokenizer:
    """Text of a growing token list, handed out in deltas that never split a UTF-8 character
    and, while a stop string might be forming, hold back its possible start.

    Constant work per token: each update decodes only a short window, the tokens since the
    last point where the text was whole (vLLM's prefix/read offsets), not the whole output.
    Decoding restarts cleanly there because the text before it was complete characters. While
    the window ends inside a UTF-8 sequence its text waits; finish() flushes it, so a finished
    request's text is exactly tokenizer.decode(its tokens), replacement characters included.

    A migrated request's continuation starts from `prefix` (the output tokens the client
    already has) with `emitted` (the characters of their text it already has): its text is
    that of the whole output, so stop strings match across the migration point and text the
    dead worker held back (a possible stop string's start, an incomplete character) comes
    out here."""

    def __init__(self, tokenizer: Tokenizer | None, prefix: Sequence[int] = (), emitted: int = 0):
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # the prefix, then the output tokens seen so far
        self.text = ""
        self.emitted = emitted  # characters of the text already handed out
        self._outputs = 0  # output tokens seen (update() gets the whole output list each time)
        self._prefix_at = 0  # window start: the text of ids[:_read_at] is in self.text
        self._read_at = 0
        self._cut = False
        self._extend(list(prefix))

    def update(self, token_ids: list[int]) -> None:
        """`token_ids`: the request's whole output so far; only the new tail is decoded."""
        new = token_ids[self._outputs:]
        self._outputs = len(token_ids)
        self._extend(new)

    def _extend(self, new: list[int]) -> None:
        if self.tokenizer is None or not new or self._cut:
            return
        self.ids.extend(new)
        self._advance(final=False)

    def _advance(self, final: bool) -> None:
        seen = self.tokenizer.decode(self.ids[self._prefix_at:self._read_at])
        window = self.tokenizer.decode(self.ids[self._prefix_at:])
        if window.endswith("\ufffd") and not final:  # an incomplete character: wait for more tokens
            return
        self.text += window[len(seen):]
        self._prefix_at, self._read_at = self._read_at, len(self.ids)

    def finish(self) -> None:
        """The request ended: hand the held tokens' text out as decode() gives it."""
        if self.tokenizer is not None and not self._cut and self._read_at < len(self.ids):
            self._advance(final=True)

    def cut(self, at: int) -> None:
        """A stop string starts at character `at`: the text ends there, for good."""
        self.text = self.text[:at]
        self._cut = True

    def take(self, holdback: int = 0) -> str:
        """Text not handed out yet, keeping the last `holdback` characters back. Never hands out
        a character twice, also while the text is shorter than what was handed out (a continuation
        whose prefix ends in an incomplete character)."""
        upto = max(self.emitted, len(self.text) - holdback)
        delta, self.emitted = self.text[self.emitted:upto], upto
        return delta


def _token_text(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok

