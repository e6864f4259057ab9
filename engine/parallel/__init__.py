"""Tensor and expert parallelism applied to the single-device model (engine.models).

config: ParallelConfig. group: a process group over a store (gloo on CPU, NCCL on CUDA).
sharding: which heads, vocab rows, intermediate columns and experts a rank owns.
layers: the parallel modules swapped into the model. loader: per-rank weights straight from
the safetensors shards. runner: rank 0 broadcasts each step's batch; the other ranks follow.
"""
from engine.parallel.config import ParallelConfig

__all__ = ["ParallelConfig"]
