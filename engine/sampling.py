"""Per-request sampling parameters, validated at construction."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16


class InvalidRequest(ValueError):
    """A request the engine refuses; `field` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequest("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequest("temperature", f"must be finite and >= 0, got {self.temperature}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidRequest("top_k", f"must be -1 (disabled) or >= 0, got {self.top_k}")
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequest("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        for name in ("resumed_tokens", "resumed_chars"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise InvalidRequest(name, f"must be an integer >= 0, got {value!r}")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token and the top-n alternatives at one position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
