"""brigade-client: the Python SDK for Brigade's gRPC API (sync Client, asyncio AsyncClient)."""
from brigade_client.aio import AsyncClient
from brigade_client.client import Client
from brigade_client.errors import (
    BrigadeError,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from brigade_client.types import Chunk, Completion, Model, SpeculativeUsage, Timing, TokenLogprob, Usage

__all__ = [
    "AsyncClient", "BrigadeError", "Cancelled", "Chunk", "Client", "Completion", "DeadlineExceeded",
    "InvalidArgument", "Model", "NotFound", "ResourceExhausted", "SpeculativeUsage", "Timing", "TokenLogprob",
    "Unauthenticated", "Unavailable", "Usage",
]
