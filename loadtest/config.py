"""The one typed config of a `brigade bench run`, built from flags by loadtest/cli.py."""
from __future__ import annotations

import math
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loadtest.arrivals import Process
from loadtest.metrics import parse_slo
from loadtest.targets import TargetConfig
from loadtest.workloads import WorkloadConfig


class LoadConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    request_rates: list[float] = Field(default_factory=lambda: [math.inf],
                                       description="sessions per second, one run each (inf: all at once)")
    arrival: Process = "poisson"
    burstiness: float = Field(1.0, gt=0, description="gamma shape: 1 Poisson, < 1 burstier, > 1 smoother")
    max_concurrency: int | None = Field(None, ge=1, description="requests in flight at most (closed loop)")
    warmup: int = Field(0, ge=0, description="requests sent and discarded before each run")
    duration_s: float | None = Field(None, gt=0, description="stop starting sessions after this long")

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, rates: list[float]) -> list[float]:
        if not rates or any(not r > 0 for r in rates):
            raise ValueError(f"request rates must be > 0 or inf, got {rates}")
        return rates


class BenchConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    target: TargetConfig = TargetConfig()
    workload: WorkloadConfig
    load: LoadConfig = LoadConfig()
    slo: str | None = Field(None, description="e.g. ttft=200ms,tpot=50ms: goodput counts requests meeting all")
    output_dir: Path = Path("bench-results")
    label: str | None = None
    progress: bool = True

    @field_validator("slo")
    @classmethod
    def _slo(cls, value: str | None) -> str | None:
        parse_slo(value)
        return value

    @model_validator(mode="after")
    def _consistent(self) -> BenchConfig:
        if self.target.endpoint == "chat" and self.workload.prompt_format == "ids":
            raise ValueError("the chat endpoint takes text: pass --prompt-format text with --endpoint chat")
        if self.load.arrival == "trace" and self.workload.kind != "trace":
            raise ValueError("--arrival trace needs --workload trace (other workloads have no timestamps)")
        return self
