"""Load one rank's part of an HF checkpoint: each tensor is read through safetensors'
get_slice, so a rank reads only its own rows/columns/experts from the shard files (no rank
materialises the full model), then filled by engine.loader's single-device rules into a
model whose shapes are the rank's (ShardPlan.local_config) and whose modules are the
parallel ones (engine.parallel.layers).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from engine.loader import (
    _EXPERT,
    _FUSED_EXPERT,
    CheckpointError,
    _check_complete,
    _destination,
    _targets,
    checkpoint_files,
    materialise,
)
from engine.models import CausalLM
from engine.models.layers import GatedMLP, RotaryEmbedding, SparseMoE
from engine.parallel.group import Group
from engine.parallel.layers import ParallelLMHead, ParallelMoE, RowParallelLinear, VocabParallelEmbedding
from engine.parallel.sharding import ShardPlan

_Slice = tuple[slice, ...]


def load_parallel_model(path: Path, plan: ShardPlan, dtype: torch.dtype, device: torch.device,
                        group: Group) -> CausalLM:
    local = plan.local_config()
    with torch.device("meta"):
        model = CausalLM(local)
        parallelize(model, plan, group)
    model = materialise(model, dtype, device)
    model.rotary = RotaryEmbedding(local.head_dim, local.max_position_embeddings, local.rope_theta,
                                   local.rope_scaling).to(device)
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: dict[str, int] = {}
    for f in checkpoint_files(path):
        with safe_open(str(f), framework="pt", device="cpu") as st:
            for hf_name in st.keys():
                part = _rank_part(hf_name, st, plan)
                if part is None:
                    continue  # another rank's expert
                name_as, tensor = part
                for name, fill in _targets(name_as, local):
                    dst = _destination(params, name)
                    if dst is None:
                        raise CheckpointError(f"unexpected tensor {hf_name!r} for a {local.architecture} model")
                    fill(dst, tensor, hf_name)
                    filled[name] = filled.get(name, 0) + 1
    if local.tie_word_embeddings:
        _destination(params, "lm_head.weight").copy_(model.embed_tokens.weight.data)
        filled["lm_head.weight"] = 1
    _check_complete(model, local, filled)
    return model.eval()


def parallelize(model: CausalLM, plan: ShardPlan, group: Group) -> None:
    """Swap in the parallel modules (on the meta device, before any weight exists)."""
    local, cfg = model.config, plan.cfg
    if plan.tp_size > 1:
        model.embed_tokens = VocabParallelEmbedding(local.vocab_size, cfg.hidden_size, plan.vocab[0], group)
        model.lm_head = ParallelLMHead(cfg.hidden_size, local.vocab_size, cfg.vocab_size, group)
    for layer in model.layers:
        attn = layer.self_attn
        if plan.tp_size > 1:
            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size, cfg.attention_bias, group)
        if isinstance(layer.mlp, SparseMoE):
            first, count = plan.experts
            layer.mlp = ParallelMoE(cfg.hidden_size, local.moe_intermediate_size, cfg.num_experts, first, count,
                                    cfg.num_experts_per_tok, cfg.norm_topk_prob, group)
        elif isinstance(layer.mlp, GatedMLP) and plan.tp_size > 1:
            layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, cfg.hidden_size, False, group)


def _rank_part(hf: str, st, plan: ShardPlan) -> tuple[str, torch.Tensor] | None:
    """(the name to load it as, this rank's slice of the tensor), or None if not this rank's."""
    name = hf.removeprefix("model.")
    shape = st.get_slice(hf).get_shape()
    full: _Slice = tuple(slice(None) for _ in shape)
    if m := _EXPERT.match(name):
        return _expert_part(hf, st, plan, m)
    if m := _FUSED_EXPERT.match(name):
        return _fused_experts_part(hf, st, plan, m)
    if plan.tp_size == 1:
        return hf, _read(st, hf, full)
    return _tensor_parallel_part(hf, st, plan, name, full)


def _tensor_parallel_part(hf: str, st, plan: ShardPlan, name: str, full: _Slice) -> tuple[str, torch.Tensor]:
    """This TP rank's slice of a dense model tensor: heads, vocabulary rows or MLP columns."""
    parts = name.split(".")
    proj, hd = (parts[-2] if len(parts) >= 2 else ""), plan.cfg.head_dim
    rows = None
    if name in ("embed_tokens.weight", "lm_head.weight"):
        first, count = plan.vocab
        t = _read(st, hf, (slice(first, first + count), slice(None)))
        if t.shape[0] < count:  # the last rank's padding rows: never looked up, cut from the logits
            t = torch.cat([t, t.new_zeros(count - t.shape[0], t.shape[1])])
        return hf, t
    if proj == "q_proj":
        rows = plan.q_heads
    elif proj in ("k_proj", "v_proj"):
        rows = plan.kv_heads
    if rows is not None:
        return hf, _read(st, hf, (slice(rows[0] * hd, (rows[0] + rows[1]) * hd),) + full[1:])
    if proj in ("gate_proj", "up_proj"):
        s, n = plan.intermediate
        return hf, _read(st, hf, (slice(s, s + n),) + full[1:])
    if proj in ("o_proj", "down_proj"):
        if parts[-1] == "bias":  # added once, after the all-reduce sums the partial outputs
            t = _read(st, hf, full)
            return hf, t if plan.tp_rank == 0 else torch.zeros_like(t)
        s, n = plan.q_heads if proj == "o_proj" else plan.intermediate
        if proj == "o_proj":
            s, n = s * hd, n * hd
        return hf, _read(st, hf, (slice(None), slice(s, s + n)))
    return hf, _read(st, hf, full)


def _expert_part(hf: str, st, plan: ShardPlan, m: re.Match) -> tuple[str, torch.Tensor] | None:
    """One routed expert's matrix, if this rank holds the expert: its slice of the expert's MLP."""
    prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
    first, count = plan.experts
    if not first <= expert < first + count:
        return None
    s, n = plan.moe_intermediate
    cut = (slice(None), slice(s, s + n)) if proj == "down_proj" else (slice(s, s + n), slice(None))
    return f"model.{prefix}.experts.{expert - first}.{proj}.weight", _read(st, hf, cut)


def _fused_experts_part(hf: str, st, plan: ShardPlan, m: re.Match) -> tuple[str, torch.Tensor]:
    """This rank's experts of a fused (E, ...) expert tensor, each cut to its MLP slice."""
    first, count = plan.experts
    experts, (s, n) = slice(first, first + count), plan.moe_intermediate
    if m.group(2) == "down_proj":  # (E, H, I)
        return hf, _read(st, hf, (experts, slice(None), slice(s, s + n)))
    inter = plan.cfg.moe_intermediate_size  # gate_up_proj (E, 2I, H): the gate half, then the up half
    return hf, torch.cat([_read(st, hf, (experts, slice(o + s, o + s + n), slice(None))) for o in (0, inter)],
                         dim=1)


def _read(st, name: str, cut: _Slice) -> torch.Tensor:
    return st.get_slice(name)[cut]
