"""Typed results the engine hands to its callers."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.sampling import TokenLogprobs


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    # Where the cached tokens came from, by tier ("device", "host", "disk"); sums to cached_tokens.
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: tokens proposed, of those accepted, and verification steps (0 without it).
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_steps: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / proposed tokens (0 when nothing was proposed)."""
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_accepted_per_step(self) -> float:
        """Mean proposals accepted per verification step."""
        return self.spec_accepted_tokens / self.spec_steps if self.spec_steps else 0.0


@dataclass
class RequestOutput:
    """A request's state after a step. `new_token_ids` are the tokens produced by this step."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    new_token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None while running
    usage: Usage
    logprobs: list[TokenLogprobs] | None = None
    new_text: str = ""
    kv_ready: bool = False  # prefill role: first token sampled, KV waiting for export_kv()
    # Set when this request alone failed in a step (finish_reason "error"): what the client may
    # read, a log id and no internal text. The engine and the rest of the batch go on.
    error: str | None = None


@dataclass
class KVExport:
    """A prefilled request's KV, handed from a prefill-role engine to a decode-role one.

    `kv` is (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim) on the
    exporting engine's device; only the first `num_tokens` token slots are meaningful.
    `draft_kv` is the draft model's KV of the same tokens, in its own layout, when it is
    shipped (speculative.draft_kv "ship"); None otherwise.
    """

    request_id: str
    prompt_token_ids: list[int]
    first_token_id: int
    num_tokens: int
    kv: torch.Tensor
    block_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    first_logprobs: TokenLogprobs | None = None
    draft_kv: torch.Tensor | None = None
