"""The shipped model shapes are the published config.json values (sources in each file's
"_source"), and the parameter counts they give are the models' advertised sizes."""
from __future__ import annotations

import pytest

from sim.shapes import load_shape, model_names

# name: (hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, experts, per token, expert MLP, tied)
PUBLISHED = {
    "SmolLM2-135M": (576, 30, 9, 3, 64, 1536, 49152, 0, 0, 0, True),
    "Qwen2.5-0.5B": (896, 24, 14, 2, 64, 4864, 151936, 0, 0, 0, True),
    "Qwen2.5-1.5B": (1536, 28, 12, 2, 128, 8960, 151936, 0, 0, 0, True),
    "Qwen2.5-7B": (3584, 28, 28, 4, 128, 18944, 152064, 0, 0, 0, False),
    "Qwen3-32B": (5120, 64, 64, 8, 128, 25600, 151936, 0, 0, 0, False),
    "Llama-3-70B": (8192, 80, 64, 8, 128, 28672, 128256, 0, 0, 0, False),
    "Qwen3-30B-A3B": (2048, 48, 32, 4, 128, 6144, 151936, 128, 8, 768, False),
}
# Advertised totals (billions; Qwen's model cards, Meta's and HF's): Qwen's figures count biases
# and norms, which the cost model leaves out, so 3% is the tolerance.
SIZES_B = {"SmolLM2-135M": 0.135, "Qwen2.5-0.5B": 0.49, "Qwen2.5-1.5B": 1.54, "Qwen2.5-7B": 7.61,
           "Qwen3-32B": 32.8, "Llama-3-70B": 70.6, "Qwen3-30B-A3B": 30.5}


def test_every_shipped_shape_is_pinned() -> None:
    assert set(model_names()) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_match_the_published_config(name: str) -> None:
    s = load_shape(name)
    got = (s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.vocab, s.experts,
           s.experts_per_tok, s.moe_intermediate, s.tied_embeddings)
    assert got == PUBLISHED[name]
    assert s.params / 1e9 == pytest.approx(SIZES_B[name], rel=0.03)
