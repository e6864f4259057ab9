"""Which part of the model one rank owns, and the per-rank ModelConfig that describes it.

Attention: rank r of tp holds query heads [r*H/tp, (r+1)*H/tp). KV heads follow their
queries: with Hkv >= tp each rank holds Hkv/tp of them; with Hkv < tp (GQA with few KV
heads) every KV head is replicated on tp/Hkv ranks, each rank holding the one KV head its
queries read. So tp must divide H, and Hkv and tp must divide one another. The KV pool of a
rank holds only its own KV heads.

Vocabulary: ceil(V/tp) rows per rank (the last rank's tail is zero padding, cut off after
the logits are gathered). Dense MLPs: intermediate/tp columns. MoE: with ep > 1 each rank
holds num_experts/ep whole experts; with tp > 1 and ep = 1 every expert is split like a
dense MLP.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from engine.model_config import ModelConfig
from engine.parallel.config import ParallelConfig


def kv_head_range(num_heads: int, num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) held by `rank` of a tp_size group (the replication rule above)."""
    check_heads(num_heads, num_kv_heads, tp_size)
    if num_kv_heads >= tp_size:
        count = num_kv_heads // tp_size
        return rank * count, count
    return rank * num_kv_heads // tp_size, 1


def check_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"tp_size {tp_size} must divide the model's {num_heads} attention heads")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"tp_size {tp_size} and the model's {num_kv_heads} KV heads must divide one another")


@dataclass(frozen=True)
class ShardPlan:
    cfg: ModelConfig  # the whole model's
    tp_size: int = 1
    ep_size: int = 1
    rank: int = 0

    @classmethod
    def of(cls, cfg: ModelConfig, parallel: ParallelConfig) -> ShardPlan:
        plan = cls(cfg, parallel.tp_size, parallel.ep_size, parallel.rank)
        plan.validate()
        return plan

    @property
    def tp_rank(self) -> int:
        return self.rank if self.tp_size > 1 else 0

    @property
    def ep_rank(self) -> int:
        return self.rank if self.ep_size > 1 else 0

    def validate(self) -> None:
        c = self.cfg
        check_heads(c.num_heads, c.num_kv_heads, self.tp_size)
        if c.intermediate_size % self.tp_size:
            raise ValueError(f"tp_size {self.tp_size} must divide intermediate_size {c.intermediate_size}")
        if c.num_experts:
            if c.num_experts % self.ep_size:
                raise ValueError(f"ep_size {self.ep_size} must divide the model's {c.num_experts} experts")
            if self.ep_size == 1 and c.moe_intermediate_size % self.tp_size:
                raise ValueError(f"tp_size {self.tp_size} must divide moe_intermediate_size "
                                 f"{c.moe_intermediate_size}")
        elif self.ep_size > 1:
            raise ValueError(f"ep_size {self.ep_size} needs an MoE model; {c.architecture} has no experts")

    @property
    def q_heads(self) -> tuple[int, int]:
        count = self.cfg.num_heads // self.tp_size
        return self.tp_rank * count, count

    @property
    def kv_heads(self) -> tuple[int, int]:
        return kv_head_range(self.cfg.num_heads, self.cfg.num_kv_heads, self.tp_size, self.tp_rank)

    @property
    def vocab(self) -> tuple[int, int]:
        """(first row, rows incl. padding); the real rows end at cfg.vocab_size."""
        count = -(-self.cfg.vocab_size // self.tp_size)
        return self.tp_rank * count, count

    @property
    def intermediate(self) -> tuple[int, int]:
        count = self.cfg.intermediate_size // self.tp_size
        return self.tp_rank * count, count

    @property
    def experts(self) -> tuple[int, int]:
        count = self.cfg.num_experts // self.ep_size
        return self.ep_rank * count, count

    @property
    def moe_intermediate(self) -> tuple[int, int]:
        if self.ep_size > 1:  # whole experts per rank
            return 0, self.cfg.moe_intermediate_size
        count = self.cfg.moe_intermediate_size // self.tp_size
        return self.tp_rank * count, count

    def local_config(self) -> ModelConfig:
        """The shapes this rank's modules and KV pool have."""
        return replace(self.cfg, vocab_size=self.vocab[1], num_heads=self.q_heads[1],
                       num_kv_heads=self.kv_heads[1], intermediate_size=self.intermediate[1],
                       num_experts=self.experts[1], moe_intermediate_size=self.moe_intermediate[1])
