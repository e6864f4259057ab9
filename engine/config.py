"""Typed configuration for the engine: one small frozen model per concern.

Each component receives only its own sub-config. `EngineConfig` composes them and is
built once (from CLI flags or a file) at the edge.
"""
from __future__ import annotations

from enum import Enum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.parallel.config import ParallelConfig


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


Frozen = _Frozen  # the one frozen, extra-forbidding base of every config (router/ and cluster/ too)


class Role(str, Enum):
    """What an engine does with a request.

    mixed: prefill and decode in one engine. prefill: finish each request after its
    first token and keep its KV blocks for export. decode: accept requests together
    with their KV blocks and first token.
    """

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class HiCacheConfig(_Frozen):
    """Host-memory (L2) and disk (L3) tiers under the device pool (L1); off unless enabled."""

    enabled: bool = False
    # L2 budget: bytes of KV blocks kept in host memory (pinned on CUDA).
    host_bytes: int = Field(1 << 30, ge=0)
    # L3: a directory on local disk (created 0700); None leaves L3 off.
    disk_dir: str | None = None
    disk_bytes: int = Field(8 << 30, ge=0)
    # write_through: copy each block to L2 when it is cached in L1 (L1 evictions then cost nothing).
    # write_back: copy to L2 only when L1 evicts it. L2 -> L3 is always written back on L2 eviction.
    write_policy: Literal["write_through", "write_back"] = "write_through"
    # Selective: a block goes down a tier only once it was hit this often (0: every block).
    hit_threshold: int = Field(0, ge=0)
    # wait: a queued request's L3 reads always complete before its prefill; best_effort: blocks
    # not read within prefetch_timeout_s of scheduling are recomputed.
    prefetch_policy: Literal["wait", "best_effort"] = "wait"
    prefetch_timeout_s: float = Field(0.05, ge=0.0)


class CacheConfig(_Frozen):
    block_size: int = Field(16, ge=1, le=1024)
    # Number of KV blocks in the device pool. None: size from `memory_fraction`
    # of free device memory on CUDA, or from `cpu_kv_bytes` on CPU.
    num_blocks: int | None = Field(None, ge=2)
    cpu_kv_bytes: int = Field(256 << 20, ge=1 << 16)
    memory_fraction: float = Field(0.85, gt=0.0, le=1.0)
    enable_prefix_cache: bool = True
    # Keep a log of cache events (engine.cache_events) for a prefix-index publisher to take.
    record_events: bool = False
    hicache: HiCacheConfig = HiCacheConfig()


class SchedulerConfig(_Frozen):
    max_num_seqs: int = Field(128, ge=1)
    # Tokens processed per step (prefill chunks + one per running decode).
    max_num_batched_tokens: int = Field(2048, ge=16)
    # Split long prompts into chunks that fit the step budget.
    enable_chunked_prefill: bool = True


class SpeculativeConfig(_Frozen):
    """Speculative decoding (engine.spec): propose k tokens cheaply, verify them in one target pass.

    method "ngram": prompt lookup, the longest n-gram (n down to n_min) ending the context that also
    occurs earlier in it proposes what followed it there. "draft": `draft_model` (same vocabulary)
    proposes with its own runner, KV pool and prefix cache. Off ("none") by default.
    """

    method: Literal["none", "ngram", "draft"] = "none"
    k: int = Field(4, ge=1, le=16)  # most tokens proposed per request per step
    n: int = Field(3, ge=1, le=16)  # ngram: longest n-gram matched
    n_min: int = Field(2, ge=1, le=16)  # ngram: shortest, capped by n (1-grams match by chance too often to pay)
    draft_model: str | None = None
    # The draft's KV pool; None: as many blocks as the target's pool (a smaller model's are smaller).
    draft_num_blocks: int | None = Field(None, ge=2)
    # Adaptive k (engine.spec.adaptive): cost of one more proposed token, as a fraction of a plain
    # decode step (drafting it + verifying it); a request's k maximises tokens per unit cost.
    token_cost: float = Field(0.1, ge=0.0, le=1.0)
    # Speculation is skipped in a step with more running decodes than this (the step is then
    # compute-bound: verified tokens cost as much as plain ones). Seeded sampled requests keep
    # speculating, so their tokens never depend on their batch.
    max_batch: int = Field(8, ge=1)
    # Disaggregated, method draft: "ship": the prefill worker also prefills the draft model and
    # sends the draft's prompt KV with the target's (the decode worker proposes from its first
    # step without computing the prompt); "recompute": the decode worker's draft computes the
    # prompt itself on the request's first decode step. Compared by spec_bench.py (raw.disagg_draft_kv).
    draft_kv: Literal["ship", "recompute"] = "ship"
    # The draft's weights: "int8" per output channel or "int4" in groups of 32 at load
    # (engine.quant; int4 is CPU only). A draft's proposals are all verified, so its precision
    # moves only its acceptance, and on a memory-bound CPU fewer bytes make a cheaper step
    # (Qwen2.5-Coder-0.5B on a 2-core Xeon: 48 ms int8, 29 ms int4, acceptance 0.86 both).
    draft_quantization: Literal["none", "int8", "int4"] = "none"

    @model_validator(mode="after")
    def _check(self) -> SpeculativeConfig:
        if self.method == "draft" and not self.draft_model:
            raise ValueError("speculative: method draft needs draft_model (--speculative draft=MODEL,k=4)")
        if self.method != "draft" and self.draft_model:
            raise ValueError("speculative: draft_model is set but method is not draft")
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    @classmethod
    def from_flag(cls, text: str) -> SpeculativeConfig:
        """`draft=MODEL,k=4` | `ngram,k=4,n=3` | `none` (the --speculative flag) -> a config."""
        fields: dict = {}
        for i, part in enumerate(p.strip() for p in text.split(",")):
            key, eq, value = part.partition("=")
            if i == 0 and key in ("none", "ngram") and not eq:
                fields["method"] = key
            elif i == 0 and key == "draft" and eq:
                fields.update(method="draft", draft_model=value)
            elif i and key in ("k", "n", "n_min", "draft_num_blocks", "max_batch") and eq:
                fields[key] = value
            elif i and key in ("token_cost", "draft_kv", "draft_quantization") and eq:
                fields[key] = value
            else:
                raise ValueError(f"speculative: cannot read {part!r} in {text!r}; expected "
                                 "draft=MODEL,k=4 or ngram,k=4,n=3 (also n_min, token_cost, max_batch, "
                                 "draft_num_blocks, draft_kv=ship|recompute, draft_quantization=int8|int4) or none")
        try:
            return cls.model_validate(fields)
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'value'}: {e['msg']}" for e in exc.errors())
            raise ValueError(f"--speculative {text!r}: {problems}") from None


class EngineConfig(_Frozen):
    model: str = "tiny"
    # Salts block hashes so two models never share prefix-cache entries; defaults to the
    # preset name or the checkpoint directory's name.
    model_id: str | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    role: Role = Role.MIXED
    seed: int = 0
    # Caps prompt + output length below the model's own limit when set.
    max_model_len: int | None = Field(None, ge=1)
    num_threads: int | None = Field(None, ge=1)
    # Weight-only quantization (engine.quant): "int8" per channel or "int4" per 32 inputs (CPU
    # only) at load; "gguf" keeps a GGUF checkpoint's Q4/Q8_0 blocks quantized. Activations then
    # run in bfloat16 around the matmuls.
    quantization: Literal["none", "int8", "int4", "gguf"] = "none"
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    # Tensor/expert parallel split of the model over ranks (engine.parallel); size 1 by default.
    parallel: ParallelConfig = ParallelConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()

    @model_validator(mode="after")
    def _check(self) -> EngineConfig:
        if self.cache.block_size > self.scheduler.max_num_batched_tokens:
            raise ValueError("cache.block_size must not exceed scheduler.max_num_batched_tokens")
        if self.cache.hicache.enabled and not self.cache.enable_prefix_cache:
            raise ValueError("cache.hicache.enabled needs cache.enable_prefix_cache")
        if self.quantization != "none" and self.parallel.world_size > 1:
            raise ValueError("quantization is not supported with tensor/expert parallel yet: use parallel size 1")
        if self.speculative.enabled and self.parallel.world_size > 1:
            raise ValueError("speculative decoding is not supported with tensor/expert parallel yet")
        return self
