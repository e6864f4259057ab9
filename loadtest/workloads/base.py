"""Fields every workload has: how prompts are written, and the seed that fixes them."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from loadtest.workloads.tokens import FIRST_ID, check_lengths

# A length spec: N, LO:HI, normal:MEAN,STD or A,B,C (see tokens.check_lengths).
LengthSpec = Annotated[str, AfterValidator(check_lengths)]


class WorkloadBase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = 0
    prompt_format: Literal["ids", "text"] = Field(
        "ids", description="token ids (exact lengths; the server must accept a list of ints) or word text")
    vocab_size: int = Field(4096, gt=FIRST_ID, description="random token ids are drawn from [16, vocab_size)")
