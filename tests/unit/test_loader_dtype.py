"""The loaders materialise each weight once, already in the target dtype: a bfloat16 model never
holds a float32 copy of its weights (on an 8B model that copy alone would be ~32 GB)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import build_hf_model
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.parallel import ParallelConfig
from engine.parallel.group import Group
from engine.parallel.loader import load_parallel_model
from engine.parallel.sharding import ShardPlan


class AllocationLog(TorchDispatchMode):
    """Every new tensor storage an op creates on a real device: (dtype, shape), once per storage."""

    def __init__(self):
        super().__init__()
        self.seen: dict[int, tuple[torch.dtype, tuple[int, ...]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel():
                self.seen.setdefault(t.untyped_storage().data_ptr(), (t.dtype, tuple(t.shape)))
        return out

    def float32_shapes(self) -> list[tuple[int, ...]]:
        return [shape for dtype, shape in self.seen.values() if dtype == torch.float32]


def bf16_checkpoint(name: str, path: Path) -> Path:
    build_hf_model(name).to(torch.bfloat16).save_pretrained(path)
    return path


def weight_shapes(model: torch.nn.Module) -> set[tuple[int, ...]]:
    return {tuple(p.shape) for p in model.parameters()} | {tuple(p.t().shape) for p in model.parameters()
                                                          if p.dim() == 2}


def assert_bf16_without_float32_copies(model: torch.nn.Module, log: AllocationLog) -> None:
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    # The only float32 tensors built are the rotary tables (kept float32 on purpose): none
    # has the shape of a weight, so no weight was ever held in float32.
    copies = [s for s in log.float32_shapes() if s in weight_shapes(model)]
    assert copies == []
    assert model.rotary.cos.dtype == torch.float32


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "llama-gqa"])
def test_load_model_never_holds_float32_weights(name, tmp_path):
    path = bf16_checkpoint(name, tmp_path / name)
    cfg = ModelConfig.from_dir(path)
    with AllocationLog() as log:
        model = load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
    assert_bf16_without_float32_copies(model, log)
    # Values are the checkpoint's (bf16 -> bf16, no rounding through another dtype).
    hf = build_hf_model(name).to(torch.bfloat16)
    assert torch.equal(model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert torch.equal(model.layers[0].input_layernorm.weight, hf.model.layers[0].input_layernorm.weight)


def test_the_log_sees_a_float32_materialisation(tmp_path):
    """The check above can fail: materialising in float32 and casting after is caught."""
    path = bf16_checkpoint("qwen3", tmp_path / "qwen3")
    from engine.models import CausalLM

    with torch.device("meta"):
        model = CausalLM(ModelConfig.from_dir(path))
    with AllocationLog() as log:
        model = model.to_empty(device="cpu").to(torch.bfloat16)  # the old order
    assert [s for s in log.float32_shapes() if s in weight_shapes(model)]


def test_parallel_loader_never_holds_float32_weights(tmp_path):
    path = bf16_checkpoint("qwen3-moe", tmp_path / "qwen3-moe")
    cfg = ModelConfig.from_dir(path)
    parallel = ParallelConfig(rendezvous=f"file://{tmp_path}/store", timeout_s=20)
    group = Group.create(parallel, torch.device("cpu"))
    try:
        with AllocationLog() as log:
            model = load_parallel_model(path, ShardPlan.of(cfg, parallel), torch.bfloat16, torch.device("cpu"),
                                        group)
    finally:
        group.close()
    assert_bf16_without_float32_copies(model, log)
