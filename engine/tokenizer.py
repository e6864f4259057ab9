"""The checkpoint's tokenizer (tokenizer.json) and chat template, plus incremental detokenizing."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from engine.sampling import InvalidRequest


class Tokenizer:
    def __init__(self, path: Path):
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, path: Path) -> Tokenizer | None:
        """None when the checkpoint ships no tokenizer (token-id prompts still work)."""
        return cls(path) if (path / "tokenizer.json").is_file() else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this model's tokenizer_config.json has no chat_template; send a plain prompt")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
        env.globals["raise_exception"] = _raise
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )


def prompt_token_ids(tokenizer: Tokenizer | None, prompt: str | Sequence[int]) -> list[int]:
    """A prompt as token ids: text goes through the tokenizer, ids pass through as ints."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("prompt", "this model has no tokenizer.json: send token ids")
        return tokenizer.encode(prompt)
    return [int(t) for t in prompt]


def chat_token_ids(tokenizer: Tokenizer | None, messages: object) -> list[int]:
    """Chat messages ([{"role", "content"}, ...]) through the model's chat template, as token ids;
    InvalidRequest (field "messages") for a malformed list or a model without a template."""
    if (not isinstance(messages, list) or not messages
            or not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                       for m in messages)):
        raise InvalidRequest("messages", "must be a non-empty list of {\"role\": str, \"content\": str}")
    if tokenizer is None or not tokenizer.chat_template:
        raise InvalidRequest("messages", "this model has no chat template: send a plain prompt instead")
    try:
        text = tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
    except jinja2.TemplateError as exc:  # the template itself refused these messages (raise_exception)
        raise InvalidRequest("messages", f"the chat template refused the messages: {exc}") from None
    return tokenizer.encode(text)


class IncrementalDetokenizer:
    """Text of a growing token list, handed out in deltas that never split a UTF-8 character
    and, while a stop string might be forming, hold back its possible start.

    A migrated request's continuation starts from `prefix` (the output tokens the client
    already has) with `emitted` (the characters of their text it already has): its text is
    that of the whole output, so stop strings match across the migration point and text the
    dead worker held back (a possible stop string's start, an incomplete character) comes
    out here."""

    def __init__(self, tokenizer: Tokenizer | None, prefix: Sequence[int] = (), emitted: int = 0):
        self.tokenizer = tokenizer
        self.prefix = list(prefix)
        self.text = ""
        self.emitted = emitted  # characters of the text already handed out

    def update(self, token_ids: list[int]) -> None:
        if self.tokenizer is None:
            return
        full = self.tokenizer.decode(self.prefix + token_ids)
        if not full.endswith("\ufffd"):  # an incomplete byte sequence: wait for the next token
            self.text = full

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


def _raise(message: str):
    raise ValueError(message)
