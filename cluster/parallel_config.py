"""The `parallel` section of the cluster config: how many ranks each worker spans."""
from __future__ import annotations

from pydantic import Field, model_validator

from engine.config import Frozen
from engine.model_config import ModelConfig
from engine.parallel import ParallelConfig
from engine.parallel.sharding import ShardPlan


class WorkerParallelism(Frozen):
    """prefill_tp: tensor-parallel ranks per prefill worker. decode_tp / decode_ep: tensor- and
    expert-parallel ranks per decode (or, colocated, mixed) worker; both above 1 must be equal
    (experts are split over the same ranks as the heads). timeout_s bounds every collective:
    a worker that lost a rank reports itself down within it and gets no traffic."""

    prefill_tp: int = Field(1, ge=1, le=64)
    decode_tp: int = Field(1, ge=1, le=64)
    decode_ep: int = Field(1, ge=1, le=64)
    timeout_s: float = Field(60.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> WorkerParallelism:
        if min(self.decode_tp, self.decode_ep) > 1 and self.decode_tp != self.decode_ep:
            raise ValueError(f"decode_tp {self.decode_tp} and decode_ep {self.decode_ep}: "
                             "when both are above 1 they must be equal")
        return self

    def sizes(self, role: str) -> tuple[int, int]:
        """(tp, ep) of a worker of `role` ("prefill", "decode" or "mixed")."""
        return (self.prefill_tp, 1) if role == "prefill" else (self.decode_tp, self.decode_ep)

    def ranks(self, role: str) -> int:
        return max(self.sizes(role))

    def check_model(self, model_cfg: ModelConfig, roles: tuple[str, ...]) -> None:
        """ValueError naming the flag if a worker's split does not fit the model (before anything starts)."""
        for role in roles:
            tp, ep = self.sizes(role)
            flag = "--prefill-tp" if role == "prefill" else ("--decode-ep" if ep > 1 else "--decode-tp")
            try:
                ShardPlan.of(model_cfg, ParallelConfig(tp_size=tp, ep_size=ep))
            except ValueError as exc:
                raise ValueError(f"{flag}: {exc}") from None
