"""A request as the engine tracks it: its tokens, progress and KV blocks."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from engine.block_hash import block_hash, salted_root
from engine.sampling import SamplingParams, TokenLogprobs


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill role: first token sampled, KV held for export
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    cached_by_tier: dict[str, int] = field(default_factory=dict)  # that hit in tokens per tier (hicache)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # roots the hash chain (engine.block_hash.salted_root)
    # Its reader is behind (LLMEngine.hold): not scheduled, its KV kept, until released.
    held: bool = False
    # Speculative decoding (engine.spec): tokens proposed, proposals accepted, verification steps.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None and self.logprobs is None:
            self.logprobs = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def update_block_hashes(self, block_size: int, model_id: str) -> list[bytes]:
        """Extend the chained hashes to cover every full block of token_ids."""
        full = self.num_tokens // block_size
        while len(self.block_hashes) < full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else salted_root(self.cache_salt)
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(block_hash(parent, tokens, model_id))
        return self.block_hashes
