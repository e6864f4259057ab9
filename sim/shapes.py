"""A model's shapes for the cost model, from any HF config.json (dense or MoE), a file shipped
in sim/data/models/, or an engine preset's config."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# The shipped shapes (sim/data/models/*.json, each naming its source in "_source") are the
# published config.json values of SmolLM2-135M(-Instruct), Qwen2.5-0.5B/1.5B/7B(-Instruct),
# Qwen3-32B, Meta-Llama-3-70B and Qwen3-30B-A3B on huggingface.co. Hugging Face is not
# reachable from this machine; each number was checked (2026-12-02) against copies of those
# files in public GitHub repositories found through the code index (e.g. verl's Qwen3-32B
# config, Megatron-Bridge's Qwen3-MoE test config, MLX / candle ports' pinned Qwen2.5 and
# SmolLM2 configs). tests/unit/test_sim_shapes.py pins them and their parameter counts.
MODELS = Path(__file__).parent / "data" / "models"


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0  # 0: dense
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    tied_embeddings: bool = False

    @classmethod
    def from_config(cls, name: str, c: dict) -> ModelShape:
        heads = c["num_attention_heads"]
        experts = c.get("num_experts") or c.get("num_local_experts") or 0
        return cls(name, c["hidden_size"], c["num_hidden_layers"], heads, c.get("num_key_value_heads", heads),
                   c.get("head_dim") or c["hidden_size"] // heads, c.get("intermediate_size", 0), c["vocab_size"],
                   experts, c.get("num_experts_per_tok", 0) if experts else 0,
                   c.get("moe_intermediate_size", 0) if experts else 0, bool(c.get("tie_word_embeddings")))

    # -- parameters (per layer unless said) ----------------------------------------------
    @property
    def attn_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q + 2 * self.hidden * kv  # q and o, k and v

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # gate, up, down of one expert

    @property
    def mlp_params(self) -> int:
        """Every MLP weight of a layer (all experts of an MoE layer)."""
        return self.experts * self.expert_params + self.hidden * self.experts if self.experts \
            else 3 * self.hidden * self.intermediate

    @property
    def active_mlp_params(self) -> int:
        """The MLP weights one token passes through."""
        return self.experts_per_tok * self.expert_params + self.hidden * self.experts if self.experts \
            else self.mlp_params

    @property
    def params(self) -> int:
        embeddings = (1 if self.tied_embeddings else 2) * self.vocab * self.hidden
        return self.layers * (self.attn_params + self.mlp_params) + embeddings

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def weight_bytes(self, dtype_bytes: int) -> float:
        return self.params * dtype_bytes


def model_names() -> list[str]:
    return sorted(p.stem for p in MODELS.glob("*.json"))


def load_shape(name_or_path: str) -> ModelShape:
    """A config.json path, a model directory holding one, a shipped name (sim/data/models), or
    an engine preset (tiny, bench)."""
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.exists():
        return ModelShape.from_config(path.parent.name if path.name == "config.json" else path.stem,
                                      json.loads(path.read_text()))
    shipped = MODELS / f"{name_or_path}.json"
    if shipped.exists():
        return ModelShape.from_config(name_or_path, json.loads(shipped.read_text()))
    from engine.presets import PRESETS

    if name_or_path in PRESETS:
        return ModelShape.from_config(name_or_path, PRESETS[name_or_path].config)
    raise ValueError(f"unknown model {name_or_path!r}: pass a config.json, one of {', '.join(model_names())}, "
                     f"or an engine preset ({', '.join(PRESETS)})")
