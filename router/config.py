"""Router settings."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class RouterConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_running: int = Field(256, ge=1)  # requests dispatched to workers at once
    max_waiting: int = Field(1024, ge=0)  # beyond this many waiting, new requests are refused at once
    health_interval_s: float = Field(1.0, gt=0)
    health_timeout_s: float = Field(5.0, gt=0)
