"""One decoder-only model covering Llama, Qwen2, Qwen3 and Qwen3-MoE (they differ in q/k/v bias, q/k norm
and MLP)."""
from __future__ import annotations

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.attention import AttentionMetadata, paged_attention
from engine.models.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, SparseMoE, apply_rotary, rms_normalize


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = Linear(cfg.hidden_size, q + 2 * kv, bias=cfg.attention_bias or cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], k_cache, v_cache, meta: AttentionMetadata):
        t, h, hd = x.shape[0], self.num_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) * hd)
        # Queries and keys stay one tensor through norm and rotary: half the small ops per layer.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, h + self.num_kv_heads, hd)  # (T, H+Hkv, hd)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, hd)  # (T, Hkv, hd)
        if self.q_norm is not None:
            weight = torch.cat((self.q_norm.weight.expand(h, hd), self.k_norm.weight.expand(self.num_kv_heads, hd)))
            qk = weight * rms_normalize(qk, self.q_norm.eps)
        qk = apply_rotary(qk, *rope)
        out = paged_attention(qk[:, :h], qk[:, h:], v, k_cache, v_cache, meta, self.scale)  # (T, H, hd)
        return self.o_proj(out.reshape(t, self.q_size))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    """forward() maps packed tokens to hidden states; compute_logits() applies the LM head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Tied checkpoints get a transposed copy of the embedding here (see Linear): one
        # extra vocab x hidden matrix of memory for a twice-faster LM head on CPU.
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # input_ids, positions: (T,); kv_cache: (2, L, NB, bs, Hkv, hd)
        x = self.embed_tokens(input_ids)  # (T, hidden)
        rope = self.rotary.tables(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, kv_cache[0, i], kv_cache[1, i], meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (N, V)
