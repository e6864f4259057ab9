"""Weight-only quantization (engine.quant) against its own float32 reference.

Tolerances: the kernels compute in bfloat16 (8 mantissa bits), so a matmul agrees with the
float32 product of the same (dequantized) weights to ~1% of its largest output; an int8 model
keeps ~all greedy top-1 choices of the float32 model on prompts of random tokens (measured
1.0 on `tiny`; asserted >= 0.9) with its logits within a few percent of their spread.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, dequantize, quantize
from helpers import engine_prefill_logits, make_prompts

from engine import CacheConfig, EngineConfig, LLMEngine
from engine.engine_setup import cpu_has_bf16_dot, resolve_dtype
from engine.model_config import ModelConfig
from engine.models.layers import Linear
from engine.quant import Int4Linear, Int8Linear, quantize_model
from engine.quant.gguf_blocks import _int4, _int8, read_blocks
from engine.quant.linear import DENSE_ROWS, int4_pack_rows

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def _close(y: torch.Tensor, ref: torch.Tensor, frac: float = 0.02) -> None:
    assert (y.float() - ref).abs().max() <= frac * ref.abs().max()


def test_int8_per_channel_round_trip_and_matmul() -> None:
    torch.manual_seed(0)
    w, x = torch.randn(96, 64), torch.randn(5, 64)
    lin = Int8Linear.quantize(w)
    # Each row's error is at most half a step of its own scale (absmax / 127).
    step = w.abs().amax(dim=1, keepdim=True) / 127
    assert torch.all((lin.dequantize() - w).abs() <= 0.5 * step * 1.01)
    _close(lin(x), x @ lin.dequantize().t())
    assert lin(x).dtype == torch.float32 and lin.q.dtype == torch.int8


@pytest.mark.parametrize("kind", [GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def test_gguf_blocks_read_exactly_and_multiply(kind) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 128)).astype(np.float32)
    raw = quantize(w, kind)
    ref = torch.from_numpy(dequantize(raw, kind))  # gguf's own dequantization, float32
    blocks = read_blocks(raw, kind)
    if kind == GGMLQuantizationType.Q8_0:
        ours = (blocks["q"].float() * blocks["d"][..., None]).reshape(48, 128)
        lin = _int8([blocks], None)
    else:
        s, z = blocks["scale"].repeat_interleave(32, 1), blocks["zero"].repeat_interleave(32, 1)
        ours = (blocks["q"] - 8) * s + z
        lin = _int4([blocks], None)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)  # the blocks, read right
    x = torch.randn(3, 128)
    _close(lin(x), x @ ref.t())
    _close(lin.dequantize(), ref)


def test_int4_unpacking_reads_torchs_packed_layout() -> None:
    """dequantize() unpacks torch's CPU int4 layout itself; the kernel, multiplying an
    identity, is the reference. Rows: whole runs of torch's packing (64 rows on AVX-512, 32 on
    AVX2) and a count it leaves to the kernel."""
    torch.manual_seed(0)
    for rows in (128, 2 * int4_pack_rows() + 16):
        q = torch.randint(0, 16, (rows, 128), dtype=torch.int32)
        lin = Int4Linear(q, torch.rand(4, rows) * 0.1, torch.randn(4, rows) * 0.1, 32)
        eye = torch.eye(128, dtype=torch.bfloat16)
        ref = torch._weight_int4pack_mm_for_cpu(eye, lin.packed, 32, lin.scale_zero).float().t()
        _close(lin.dequantize(), ref, frac=0.005)  # the kernel rounds its output to bfloat16


@pytest.mark.parametrize("rows", [3, DENSE_ROWS, 100, Int4Linear.dense_rows])
def test_quantized_linears_agree_below_and_above_the_dense_row_count(rows) -> None:
    """A prefill chunk (dense bfloat16 matmul of the dequantized weight) and a decode batch
    (the weight-only kernels) compute the same product."""
    torch.manual_seed(1)
    w = torch.randn(128, 64)
    q4 = Int4Linear(torch.randint(0, 16, (128, 64), dtype=torch.int32), torch.rand(2, 128) * 0.1,
                    torch.randn(2, 128) * 0.1, 32)
    x = torch.randn(rows, 64)
    for lin in (Int8Linear.quantize(w), q4, Int4Linear.quantize(w)):
        _close(lin(x), x @ lin.dequantize().t())


def test_int4_quantize_rounds_each_group_to_its_nearest_level() -> None:
    """Int4Linear.quantize: every weight within half a step of its group's grid, the grid spans
    the group's min to max, and a linear whose input width is not a multiple of 32 gets int8."""
    torch.manual_seed(2)
    w = torch.randn(96, 128) * torch.logspace(-2, 0, 96)[:, None]  # rows of very different size
    lin = Int4Linear.quantize(w)
    step = lin.scale_zero[..., 0].float().t().repeat_interleave(32, dim=1)  # (out, in)
    err = (lin.dequantize() - w).abs()
    # Half a step, plus bfloat16's rounding of scale, zero and the dequantized weight.
    assert (err <= step * 0.6).all()
    assert err.max() > 0  # it really is quantized
    model = torch.nn.Module()
    model.a, model.b = Linear(128, 64), Linear(48, 64)
    assert quantize_model(model, "int4", Path(".")) == {"int4": 1, "int8": 1}
    assert isinstance(model.a, Int4Linear) and isinstance(model.b, Int8Linear)


def top1_agreement_and_worst_error(ref: LLMEngine, other: LLMEngine, prompts) -> tuple[int, float]:
    """Prompts whose last-position argmax agrees, and the largest logit error in units of the
    reference's logit standard deviation."""
    agree, worst = 0, 0.0
    for p in prompts:
        a, b = engine_prefill_logits(ref, p), engine_prefill_logits(other, p)
        agree += int(a.argmax() == b.argmax())
        worst = max(worst, ((a - b).abs().max() / a.std()).item())
    return agree, worst


def test_int8_engine_tracks_its_float32_reference() -> None:
    def engine(quant: str) -> LLMEngine:
        return LLMEngine(EngineConfig(model="tiny", dtype="float32", quantization=quant,
                                      cache=CacheConfig(num_blocks=64, block_size=16)))

    ref, q8 = engine("none"), engine("int8")
    assert sum(type(m).__name__ == "Int8Linear" for m in q8.runner.model.modules()) == 2 * 4 + 1
    prompts = make_prompts([5, 17, 40, 64, 100, 9, 33, 70], seed=3)
    agree, worst = top1_agreement_and_worst_error(ref, q8, prompts)
    assert agree >= 0.9 * len(prompts)
    assert worst < 0.25


def test_dtype_auto_rule_reads_the_cpu_flags(tmp_path) -> None:
    zen3, zen4 = tmp_path / "zen3", tmp_path / "zen4"
    zen3.write_text("processor\t: 0\nflags\t\t: fpu avx2 fma avx512f\n")
    zen4.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 avx512_vnni\n")
    assert not cpu_has_bf16_dot(str(zen3)) and cpu_has_bf16_dot(str(zen4))
    assert not cpu_has_bf16_dot(str(tmp_path / "missing"))
    xeon = tmp_path / "xeon"  # AMX without avx512_bf16 in the list still multiplies bfloat16
    xeon.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_tile amx_bf16\n")
    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=12, num_layers=1,
                      num_heads=2, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=64, tie_word_embeddings=False, torch_dtype="float16")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    auto = {f.name: resolve_dtype("auto", cfg, cpu, str(f)) for f in (zen3, zen4, xeon, tmp_path / "missing")}
    assert auto == {"zen3": torch.float32, "zen4": torch.bfloat16, "xeon": torch.bfloat16, "missing": torch.float32}
    assert resolve_dtype("auto", cfg, cuda, str(zen3)) == torch.float16  # CUDA: the checkpoint's dtype
    assert resolve_dtype("float32", cfg, cpu, str(zen4)) == torch.float32  # a named dtype is kept
    assert resolve_dtype("bfloat16", cfg, cpu, str(zen3)) == torch.bfloat16


def test_gguf_quantization_needs_a_gguf_source() -> None:
    with pytest.raises(ValueError, match="GGUF"):
        LLMEngine(EngineConfig(model="tiny", dtype="float32", quantization="gguf", cache=CacheConfig(num_blocks=16)))


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_bfloat16_tracks_its_float32_reference(name, hf_checkpoints) -> None:
    """bfloat16 (weights, KV and activations) against the same checkpoint in float32: top-1
    agreement on >= 85% of prompts (measured 32/32 on llama-gqa, 31/32 on qwen3: random weights
    leave some argmax margins below bfloat16's rounding) and every logit within 0.2 standard
    deviations of the float32 one (measured at most 0.14)."""
    from helpers import make_engine

    path = hf_checkpoints.get(name)
    ref, bf = make_engine(path, block_size=4), make_engine(path, block_size=4, dtype="bfloat16")
    prompts = make_prompts([3, 16, 17, 31, 64, 100, 7, 50] * 2, seed=5)
    agree, worst = top1_agreement_and_worst_error(ref, bf, prompts)
    assert agree >= 0.85 * len(prompts)
    assert worst < 0.2
