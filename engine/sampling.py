"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # one stop string; the detokenizer holds back this much text while it could complete
MAX_STOP_TOTAL_CHARS = 1024  # all stop strings together: each step searches the text for every one
MAX_STOP_TOKEN_IDS = 64
MAX_TOKENS_LIMIT = 2**31 - 1  # far above any context; the engine checks the real bound (check_request)
SEED_RANGE = (-(2**63), 2**64)  # int64 or uint64: what torch generators take (a migration's shifted seed is uint64)
GREEDY_BELOW = 1e-5  # a temperature this small is greedy: dividing logits by it overflows to inf


class InvalidRequest(ValueError):
    """A request the engine refuses; `field` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    """Every field is bounded here, whatever door built it (the vocabulary-dependent bounds,
    top_k and stop_token_ids, are checked with the model's shape in check_request): a value
    that passes cannot overflow a tensor or make a step's work grow without limit."""

    max_tokens: int = 16
    temperature: float = 1.0  # below GREEDY_BELOW (0 included) means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token
    # A migrated request's continuation (router/migration.py): the prompt's last `resumed_tokens`
    # are output the client already has, `resumed_chars` characters of their text. The engine's
    # detokenizer and stop strings run over the whole output, and text resumes after those characters.
    resumed_tokens: int = 0
    resumed_chars: int = 0
    # False: this request never speculates, even on an engine with speculative decoding on.
    speculate: bool = True

    def __post_init__(self) -> None:
        _integer("max_tokens", self.max_tokens, 1, MAX_TOKENS_LIMIT)
        for name in ("temperature", "top_p", "min_p"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        if self.temperature < 0:
            raise InvalidRequest("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        _integer("top_k", self.top_k, -1, None, "-1 (disabled) or >= 0")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _integer("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - 1)
        for name in ("ignore_eos", "speculate"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, f"must be true or false, got {_show(getattr(self, name))}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"in [0, {MAX_LOGPROBS}]")
        for name in ("resumed_tokens", "resumed_chars"):
            _integer(name, getattr(self, name), 0, None)
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


def _show(value: object) -> str:
    """A value for an error message, short whatever its size (repr of a huge int raises)."""
    try:
        text = repr(value)
    except ValueError:
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 40 else text[:37] + "..."


def _integer(name: str, value: object, lo: int, hi: int | None, expected: str | None = None) -> None:
    """Refuse a non-integer (bools included) or one outside [lo, hi]."""
    if not isinstance(value, int) or isinstance(value, bool) or value < lo or (hi is not None and value > hi):
        expected = expected or (f"in [{lo}, {hi}]" if hi is not None else f">= {lo}")
        raise InvalidRequest(name, f"must be an integer {expected}, got {_show(value)}")


def _number(name: str, value: object) -> float:
    """A finite float from an int or float; an int too large for a float is refused, not an OverflowError."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise InvalidRequest(name, f"must be a finite number, got {_show(value)}")


def _stop_strings(stop: object) -> tuple[str, ...]:
    stop = (stop,) if isinstance(stop, str) else tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    if not all(isinstance(s, str) for s in stop):
        raise InvalidRequest("stop", "stop strings must be strings")
    if any(not s for s in stop):
        raise InvalidRequest("stop", "stop strings must be non-empty")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise InvalidRequest("stop", f"each stop string is at most {MAX_STOP_CHARS} characters")
    if sum(map(len, stop)) > MAX_STOP_TOTAL_CHARS:
        raise InvalidRequest("stop", f"the stop strings together are at most {MAX_STOP_TOTAL_CHARS} characters")
    return stop


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    ids = tuple(ids)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(ids)}")
    # An integral float (3.0) is its integer; the vocabulary bound is the engine's (check_request).
    ids = tuple(int(t) if isinstance(t, float) and t.is_integer() else t for t in ids)
    for t in ids:
        _integer("stop_token_ids", t, 0, None, "token id >= 0")
    return ids


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
