"""Weight-only quantization applied to a loaded model (`--quantization`).

  int8  every linear (attention, dense MLP, LM head) quantized per output channel at load
  int4  every linear quantized in groups of 32 input features at load (round to nearest between
        the group's min and max, as GGUF Q4_1); CPU only (torch's int4 kernel). A linear whose
        input width is not a multiple of 32 gets int8. Out of cache on a 2-core Xeon the int4
        GEMV moves its weights ~3x faster than the int8 one (a Qwen2.5-0.5B MLP: 0.29 vs 0.92 ms):
        what a speculative draft wants (its precision moves only its acceptance)
  gguf  the checkpoint's GGUF source blocks kept quantized (Q4_0/Q4_1 -> int4, Q8_0 -> int8)
MoE experts and norms stay in the model's dtype.
"""
from __future__ import annotations

from pathlib import Path

from torch import nn

from engine.models.layers import Linear, SparseMoE
from engine.quant.linear import BlockInt8Linear, Int4Linear, Int8Linear, QuantLinear

METHODS = ("none", "int8", "int4", "gguf")
INT4_GROUP = 32
# Written by engine.gguf.convert next to a checkpoint converted from GGUF: the source file's path.
GGUF_SOURCE_MARKER = ".complete"

__all__ = ["METHODS", "BlockInt8Linear", "Int4Linear", "Int8Linear", "QuantLinear", "gguf_source", "quantize_model"]


class QuantizationError(ValueError):
    """The requested quantization does not apply to this checkpoint or configuration."""


def gguf_source(checkpoint: Path) -> Path | None:
    """The GGUF file a converted checkpoint came from (None if it did not come from one)."""
    marker = checkpoint / GGUF_SOURCE_MARKER
    if not marker.is_file():
        return None
    src = Path(marker.read_text().strip())
    return src if src.suffix == ".gguf" and src.is_file() else None


def quantize_model(model: nn.Module, method: str, checkpoint: Path) -> dict[str, int]:
    """Swap `model`'s linears in place; returns how many of each kind were replaced."""
    if method == "none":
        return {}
    if method in ("int8", "int4"):
        return _swap(model, method)
    if method == "gguf":
        src = gguf_source(checkpoint)
        if src is None:
            raise QuantizationError(
                f"--quantization gguf needs a checkpoint converted from a GGUF file (a registry model or "
                f"--model FILE.gguf); {checkpoint} has no GGUF source. Use --quantization int8 instead.")
        from engine.quant.gguf_blocks import install_gguf_blocks

        return install_gguf_blocks(model, str(src), model.config.architecture)
    raise QuantizationError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")


def _swap(model: nn.Module, method: str) -> dict[str, int]:
    weight = next(model.parameters(), None)
    if method == "int4" and weight is not None and weight.device.type != "cpu":
        raise QuantizationError(f"--quantization int4 runs torch's CPU int4 kernel; on {weight.device.type} "
                                "use int8 or none")
    counts = {"int8": 0, "int4": 0}
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            # Exact type: tensor-parallel subclasses are not quantized; MoE routers stay exact.
            if type(child) is Linear and not isinstance(parent, SparseMoE):
                w = child.weight_t.data.t() if child.transposed else child.weight.data  # (out, in)
                bias = child.bias.data if child.bias is not None else None
                if method == "int4" and w.shape[1] % INT4_GROUP == 0:
                    setattr(parent, attr, Int4Linear.quantize(w, bias, INT4_GROUP))
                    counts["int4"] += 1
                else:
                    setattr(parent, attr, Int8Linear.quantize(w, bias))
                    counts["int8"] += 1
    return {kind: n for kind, n in counts.items() if n}
