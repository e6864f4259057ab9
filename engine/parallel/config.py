"""How one engine's model is split across ranks."""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ParallelConfig(BaseModel):
    """tp_size splits attention heads, dense MLPs and the vocabulary; ep_size partitions MoE
    experts. Both run over the same ranks: world_size = max(tp_size, ep_size), and a size
    above 1 must equal it (tp=1, ep=2 replicates attention and splits only the experts).

    rendezvous: "tcp://host:port" (rank 0 hosts the store) or "file:///path" (one host). The
    ranks share a node; gloo binds its sockets to that host (127.0.0.1 for file://).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    tp_size: int = Field(1, ge=1, le=64)
    ep_size: int = Field(1, ge=1, le=64)
    rank: int = Field(0, ge=0)
    rendezvous: str = "tcp://127.0.0.1:29510"
    # Bounded wait for every collective: a group that lost a rank fails within this.
    timeout_s: float = Field(60.0, gt=0)
    backend: Literal["auto", "gloo", "nccl"] = "auto"

    @property
    def world_size(self) -> int:
        return max(self.tp_size, self.ep_size)

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        for name, size in (("tp_size", self.tp_size), ("ep_size", self.ep_size)):
            if size not in (1, self.world_size):
                raise ValueError(f"{name}={size}: with tp_size and ep_size both above 1 they must be equal")
        if self.rank >= self.world_size:
            raise ValueError(f"rank {self.rank} outside world_size {self.world_size}")
        if not self.rendezvous.startswith(("tcp://", "file://")):
            raise ValueError(f"rendezvous {self.rendezvous!r} must start with tcp:// or file://")
        return self
