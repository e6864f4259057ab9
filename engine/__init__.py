"""Brigade's single-process inference core. Imports no Ray, Redis or gRPC."""
from engine.config import CacheConfig, EngineConfig, Role, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.outputs import KVExport, RequestOutput, Usage
from engine.sampling import InvalidRequest, SamplingParams

__all__ = ["CacheConfig", "EngineConfig", "InvalidRequest", "KVExport", "LLMEngine", "RequestOutput",
           "Role", "SamplingParams", "SchedulerConfig", "Usage"]
